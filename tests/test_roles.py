"""One vocabulary for roles and worker states (shared/policy/roles.py), used by the messages,
the worker and (until it imports them) agreeing with the FluidRole policy's constants."""

from __future__ import annotations

import pytest

import shared.messages as messages
from services.worker.config import WorkerConfig
from shared.messages import MessageError, StateEvent, decode, encode
from shared.policy import fluidrole, roles
from shared.policy.roles import (
    ACTIVE,
    DECODE,
    DRAIN,
    PREFILL,
    ROLES,
    SWITCH,
    WORKER_STATES,
    is_role,
    is_worker_state,
)


def test_messages_reexport_the_policy_role() -> None:
    assert messages.ROLES is ROLES
    assert messages.Role is roles.Role


def test_fluidrole_constants_agree() -> None:
    assert (fluidrole.PREFILL, fluidrole.DECODE) == (PREFILL, DECODE)
    assert (fluidrole.ACTIVE, fluidrole.DRAIN, fluidrole.SWITCH) == (ACTIVE, DRAIN, SWITCH)


def test_guards() -> None:
    assert [r for r in ("prefill", "decode", "router", "") if is_role(r)] == list(ROLES)
    assert is_worker_state("failed") and not is_worker_state("draining")
    assert set(WORKER_STATES) >= {ACTIVE, DRAIN, SWITCH}


def test_worker_config_rejects_an_unknown_role() -> None:
    with pytest.raises(ValueError, match="role must be one of"):
        WorkerConfig(worker_id="w1", role="router", cluster_secret="s")  # type: ignore[arg-type]


def test_wire_role_is_checked_against_the_one_literal() -> None:
    event = StateEvent(
        publisher_id="w1",
        epoch=0,
        seq=0,
        time_s=1.0,
        role=DECODE,
        from_state=ACTIVE,
        to_state=DRAIN,
        reason="t",
    )
    assert decode(encode(event), StateEvent) == event
    forged = encode(event).replace(b"decode", b"router")
    with pytest.raises(MessageError):
        decode(forged, StateEvent)
