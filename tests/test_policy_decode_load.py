"""FluidRole (ADAPTIVE) P→D on decode *load* pressure: eq. 23 reads DPI̅_adm, which stays low
until the decode batch slots are full — by then a lone decode worker has been over its
TPOT-safe batch for seconds (azure-mixed 25 rps: 7P1D at DPI̅_load 0.98 for 5 s before
DPI̅_adm moved). DPI̅_load above ``p2d_load_trigger`` with prefill idle recommends P→D, sized
to bring DPI̅_load back under DPI_load^high. Pure functions, no processes."""

from __future__ import annotations

import dataclasses

import pytest

from shared.policy.config import PAPER, PolicyConfig
from shared.policy.errors import PolicyConfigError
from shared.policy.fluidrole import (
    D2P,
    DECODE,
    NONE,
    P2D,
    PREFILL,
    ClusterSnapshot,
    RolePolicy,
    WorkerView,
    recommend,
)
from shared.policy.fluidrole_sizing import move_size

CFG = PolicyConfig(n_persist=1)  # defaults: trigger 0.8, DPI_load^high 0.6, PPI_low 0.6


def cluster(
    n_p: int, n_d: int, load: float, ppi: float = 0.3, busy: float = 0.4
) -> ClusterSnapshot:
    prefill = tuple(
        WorkerView(f"p{i}", PREFILL, ppi_p95=ppi, prefill_busy_frac=busy) for i in range(n_p)
    )
    decode = tuple(
        WorkerView(
            f"d{i}",
            DECODE,
            dpi_load=load,
            dpi_adm=0.1,  # admission still has room: eq. 23 alone would not move
            active_decode_requests=20,
            max_decode_requests=64,
        )
        for i in range(n_d)
    )
    return ClusterSnapshot(prefill + decode)


def test_decode_load_over_the_trigger_recommends_p2d_only_with_prefill_idle() -> None:
    assert recommend(0.3, 0.9, 0.1, CFG) == (P2D, "decode_load_pressure")
    assert recommend(0.3, 0.79, 0.1, CFG) == (NONE, "balanced")  # under the trigger
    assert recommend(0.8, 0.9, 0.1, CFG) == (NONE, "prefill_not_idle")  # PPI̅ in the band
    off = dataclasses.replace(CFG, p2d_load_trigger=0.0)
    assert recommend(0.3, 0.9, 0.1, off) == (NONE, "balanced")
    paper = dataclasses.replace(CFG, rules=PAPER)  # eq. 23 literally: DPI_adm only
    assert recommend(0.3, 0.9, 0.1, paper) == (NONE, "balanced")


def test_load_p2d_is_sized_to_bring_decode_load_under_its_bound() -> None:
    # 7P1D, one decode worker at 0.98: one more brings it to 0.49 < 0.6 → k = 1.
    assert move_size(P2D, 0.3, 0.98, 0.1, 7, 1, CFG, prefill_busy=0.4) == 1
    # 6P2D at 0.95: 2·0.95/0.6 − 2 = 1.17 → k = 2 (predicted 0.475).
    assert move_size(P2D, 0.3, 0.95, 0.1, 6, 2, CFG, prefill_busy=0.3) == 2
    # The prefill busy bound still applies: 6 workers 70 % busy cannot give two.
    assert move_size(P2D, 0.3, 0.95, 0.1, 6, 2, CFG, prefill_busy=0.7) == 1
    # With the trigger off the load gap does not size the move (the DPI_adm gap does: 1).
    off = dataclasses.replace(CFG, p2d_load_trigger=0.0)
    assert move_size(P2D, 0.3, 0.95, 0.3, 6, 2, off, prefill_busy=0.3) == 1


def test_decide_moves_decode_ward_on_load_and_the_move_back_is_refused() -> None:
    policy = RolePolicy(CFG)
    d = policy.decide(cluster(7, 1, load=0.98), 0.0)
    assert (d.action, d.reason, d.worker_ids) == (P2D, "decode_load_pressure", ("p0",))
    # At 6P2D the load halves (0.49); D->P of one worker predicts 0.98 again, over
    # DPI_load^high: the trigger sits above the D->P bound, so the move is not undone
    # (even with prefill pressured, PPI̅ 1.2; at load 0.25 the same call would move one).
    assert move_size(D2P, 1.2, 0.49, 0.1, 6, 2, CFG) == 0
    assert move_size(D2P, 1.2, 0.25, 0.1, 6, 2, CFG) == 1


def test_the_trigger_must_sit_above_the_d2p_load_bound() -> None:
    with pytest.raises(PolicyConfigError, match="p2d_load_trigger"):
        PolicyConfig(p2d_load_trigger=0.5)  # at or below DPI_load^high (0.6): ping-pong
    assert PolicyConfig(p2d_load_trigger=0.0).p2d_load_trigger == 0.0  # off
