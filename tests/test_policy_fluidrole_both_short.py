"""FluidRole (ADAPTIVE): a saturated decode admission is read as blocking prefill (a P→D
move) only while requests wait for decode slots on every decode worker
(``blocked_waiting_batches`` batches); with the slots full but (almost) nothing waiting,
decode keeps up, the prefill queue is prefill's own, and nothing moves
(``both_phases_short``). PAPER has no such rule. Pure functions, no processes."""

from __future__ import annotations

import dataclasses

import pytest

from services.bench.shift_analysis import recommendation
from shared.policy.cluster_view import ClusterSnapshot
from shared.policy.config import PAPER, PolicyConfig
from shared.policy.errors import PolicyConfigError
from shared.policy.fluidrole import RolePolicy
from shared.policy.fluidrole_rules import NONE, P2D
from shared.policy.roles import DECODE
from tests.support.role_views import SLOTS, busy_prefill, waiting_decode

CFG = PolicyConfig(n_persist=1)


def both_pressed(waiting: tuple[int, ...], slots: int = SLOTS) -> ClusterSnapshot:
    """5 prefill workers over their TTFT (PPI 2.0, busy) and one decode worker per entry of
    ``waiting``, every slot taken and that many requests waiting for one (``slots`` 0: the
    batch limit not reported)."""
    decode = tuple(
        dataclasses.replace(w, max_decode_requests=slots) for w in waiting_decode(waiting, load=0.9)
    )
    return ClusterSnapshot(busy_prefill(5, 2.0) + decode)


def test_full_decode_slots_block_prefill_only_while_requests_wait_for_them() -> None:
    assert CFG.blocked_waiting_batches == 0.5  # the router's decode-backlog door level
    cases = (
        ((40, 40, 40), P2D, "decode_admission_blocks_prefill"),
        ((32, 32, 32), P2D, "decode_admission_blocks_prefill"),  # exactly 0.5 batch
        ((10, 10, 10), NONE, "both_phases_short"),
        ((40, 40, 31), NONE, "both_phases_short"),  # the least waiting decides
    )
    for waiting, action, reason in cases:
        d = RolePolicy(CFG).decide(both_pressed(waiting), 0.0)
        assert (d.action, d.reason) == (action, reason), waiting
        assert d.decode_waiting_batches == pytest.approx(min(waiting) / SLOTS)
        if action == P2D:
            assert d.target_role == DECODE and len(d.worker_ids) >= 1


def test_the_rule_off_or_an_unknown_batch_limit_keeps_moving_to_decode() -> None:
    off = RolePolicy(dataclasses.replace(CFG, blocked_waiting_batches=0.0))
    d = off.decide(both_pressed((10, 10, 10)), 0.0)
    assert (d.action, d.reason) == (P2D, "decode_admission_blocks_prefill")
    # No decode worker reports its batch limit: the waiting share is unknown, not checked.
    # (It recommends P->D; the busy prefill workers then leave no headroom to move one,
    # since without the batch limit decode binding is unknown too.)
    d = RolePolicy(CFG).decide(both_pressed((10, 10, 10), slots=0), 0.0)
    assert d.decode_waiting_batches is None
    assert (d.recommendation, d.reason) == (P2D, "prefill_headroom")


def test_paper_rules_neither_read_nor_publish_the_waiting_share() -> None:
    d = RolePolicy(dataclasses.replace(CFG, rules=PAPER)).decide(both_pressed((40,) * 3), 0.0)
    assert (d.action, d.reason) == (NONE, "both_phases_pressured")
    assert d.decode_waiting_batches is None and "decode_waiting_batches" not in d.inputs(8)


def test_the_published_inputs_give_the_both_short_recommendation_again() -> None:
    d = RolePolicy(CFG).decide(both_pressed((10, 10, 10)), 0.0)
    inputs = d.inputs(8)
    assert inputs["decode_waiting_batches"] == pytest.approx(10 / SLOTS)
    assert recommendation(inputs, CFG) == d.recommendation == NONE
    # Without the field the same inputs read as decode blocking prefill: it is what agrees.
    del inputs["decode_waiting_batches"]
    assert recommendation(inputs, CFG) == P2D


def test_blocked_waiting_batches_must_not_be_negative() -> None:
    with pytest.raises(PolicyConfigError, match="blocked_waiting_batches"):
        PolicyConfig(blocked_waiting_batches=-0.5)
