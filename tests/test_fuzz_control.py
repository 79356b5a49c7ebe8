"""Fuzzing every control subject with random bytes and random JSON over the raw NATS wire
(what ``nats req`` sends): each answer is an error reply (never ``internal_error``) or
silence; afterwards every process is alive, roles/states and free blocks are unchanged,
no handler crashed, and the cluster still serves a request.

Workers: ``fluidpd.worker.<id>.{switch,cancel,prefill,admit,migrate}``; controller:
``fluidpd.controller.{policy,status}``. With one prefill and one decode worker every
switch is refused by design (it would empty a role), so even a well-formed switch cannot
change state; well-formed policy commands (which legitimately flip auto mode) are left
out. A tampered KV envelope or block is rejected at the transfer layer
(tests/test_transfer.py) and end to end by tests/test_security.py (secret mismatch).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from services.common.cluster import Cluster
from shared.messages import (
    Ack,
    AdmitReply,
    ErrorReply,
    PolicyReply,
    StatusReply,
    Subjects,
    SwitchReply,
    decode_reply,
)
from tests.support.faults import fault_cluster, prompt
from tests.support.nats_wire import WireError, WireTimeout, raw_request

pytestmark = pytest.mark.timeout(180)
S = Subjects()
WORKER_VERBS = {
    "switch": SwitchReply,
    "cancel": Ack,
    "prefill": Ack,
    "admit": AdmitReply,
    "migrate": AdmitReply,
}
CONTROLLER = {S.controller_policy(): PolicyReply, S.controller_status(): StatusReply}
TARGETS = [
    (getattr(S, f"worker_{verb}")(w), reply)
    for w in ("p0", "d0")
    for verb, reply in WORKER_VERBS.items()
] + list(CONTROLLER.items())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs: Path = tmp_path_factory.mktemp("fuzz-control-logs")
    with fault_cluster(logs, num_kv_blocks=128, time_scale=0.05) as c:
        yield c


def wire(cluster: Cluster, subject: str, payload: bytes, timeout_s: float = 1.0) -> bytes | None:
    """One raw request; None on silence. Raises WireError (e.g. no responders)."""
    u = urlparse(cluster.nats_url)
    user, password = cluster.operator_credentials or (None, None)  # what `nats req` logs in as
    try:
        return raw_request(
            u.hostname or "127.0.0.1", u.port or 4222, subject, payload, timeout_s, user, password
        )
    except WireTimeout:
        return None


def snapshot(cluster: Cluster) -> dict[str, tuple[str, str, int, int]]:
    reply = json.loads(wire(cluster, S.controller_status(), b"{}") or b"{}")
    return {
        w["worker_id"]: (w["role"], w["state"], w["free_blocks"], w["total_blocks"])
        for w in reply["workers"]
    }


@pytest.fixture(scope="module")
def before(cluster: Cluster) -> dict[str, tuple[str, str, int, int]]:
    state = snapshot(cluster)
    assert set(state) == {"p0", "d0"}
    return state


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=16),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
keyed = st.dictionaries(
    st.sampled_from(["role", "request_id", "auto", "reason", "prompt_len", "ok", "_t", "_v"]),
    json_values | st.sampled_from(["prefill", "decode", "r1", "", "*", ">"]),
    max_size=4,
)
payloads = st.one_of(
    st.binary(max_size=64),
    json_values.map(lambda v: json.dumps(v).encode()),
    keyed.map(lambda v: json.dumps(v).encode()),
    st.sampled_from([b"", b"{", b"\xff\xfe", b"\x80\x81\x82", b"null", b'{"role": "decode"}']),
)


def _is_valid_policy(subject: str, payload: bytes) -> bool:
    try:
        obj = json.loads(payload)
    except ValueError:
        return False
    return subject == S.controller_policy() and isinstance(obj, dict) and "auto" in obj


def check_reply(subject: str, reply_type: type[Any], reply: bytes | None) -> None:
    if reply is None:
        return  # silence is allowed
    msg = decode_reply(reply, reply_type)
    if isinstance(msg, ErrorReply):
        assert msg.code != "internal_error", (subject, msg)
        return
    if reply_type in (Ack, StatusReply):
        return  # cancel of an unknown id, or a status: harmless
    assert getattr(msg, "ok", None) is False, (subject, msg)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(target=st.sampled_from(TARGETS), payload=payloads)
def test_fuzz_control_subjects(
    cluster: Cluster, before: dict[str, Any], target: tuple[str, type[Any]], payload: bytes
) -> None:
    subject, reply_type = target
    assume(not _is_valid_policy(subject, payload))
    try:
        reply = wire(cluster, subject, payload)
    except WireError as exc:  # "no responders": the handler is gone
        pytest.fail(f"{subject}: {exc}")
    check_reply(subject, reply_type, reply)


def test_nothing_changed_and_still_serving(cluster: Cluster, before: dict[str, Any]) -> None:
    """Runs after the fuzzing: same processes, roles, states, free blocks; still serves."""
    assert all(ch.is_running() for ch in cluster.children())
    assert snapshot(cluster) == before
    import urllib.request

    body = json.dumps({"model": "tiny", "prompt": prompt(1, 20), "max_tokens": 4}).encode()
    req = urllib.request.Request(
        cluster.router_url + "/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=20) as resp:
        assert json.loads(resp.read())["usage"]["completion_tokens"] == 4
    for ch in cluster.children():
        crashed = [ln for ln in ch.tail(200).splitlines() if "handler_crashed" in ln]
        assert not crashed, (ch.name, crashed)
