"""FluidRole (ADAPTIVE) issue-16 rules: a D→P move is bounded by the decode side's predicted
load after it (with a margin) and by the decode backlog; a P→D move is sized by that
backlog; DPI̅_adm is smoothed over the PPI window (a one-interval spike moves nothing);
PAPER keeps eq. 22–23 literally. Pure functions, no processes."""

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
    decode_demand,
)
from shared.policy.fluidrole_sizing import DecodeDemand, move_size

# The mechanisms at the values these cases were written for (the defaults moved since:
# margin 0, fill target 0.75, and a prefill busy bound; tests below cover those).
CFG = PolicyConfig(
    n_persist=1, d2p_load_margin=0.1, decode_fill_target=0.5, p2d_busy_bound=0.0
)  # median DPI̅_adm, up to 3 workers per move


def cluster(
    ppi: float,
    load: float,
    adm: float,
    n_p: int,
    n_d: int,
    running: int = 0,
    waiting: int = 0,
    slots: int = 64,
) -> ClusterSnapshot:
    prefill = tuple(WorkerView(f"p{i}", PREFILL, ppi_p95=ppi) for i in range(n_p))
    decode = tuple(
        WorkerView(
            f"d{i}",
            DECODE,
            dpi_load=load,
            dpi_adm=adm,
            active_decode_requests=running,
            decode_waiting=waiting,
            max_decode_requests=slots,
        )
        for i in range(n_d)
    )
    return ClusterSnapshot(prefill + decode)


def test_d2p_is_refused_when_the_predicted_decode_load_after_it_is_too_high() -> None:
    # The case: 2 -> 1 decode workers at DPI̅_load 0.27 predicts 0.54, which passed
    # the old bound (< 0.6) but not 0.6 − 0.1 = 0.5.
    assert move_size(D2P, 3.0, 0.27, 0.05, 6, 2, CFG) == 0
    assert move_size(D2P, 3.0, 0.24, 0.05, 6, 2, CFG) == 1  # 0.48 < 0.5
    d = RolePolicy(CFG).decide(cluster(ppi=3.0, load=0.27, adm=0.05, n_p=6, n_d=2), 0.0)
    assert (d.recommendation, d.action, d.reason) == (D2P, NONE, "decode_headroom")
    # Sizing stops at the largest k the bound allows: 4·0.2/(4−k) < 0.5 → k <= 2.
    assert move_size(D2P, 9.0, 0.2, 0.05, 4, 4, CFG) == 2
    # The paper's rule set has no such bound: eq. 22 holds (0.27 < 0.6), one worker moves.
    paper = RolePolicy(dataclasses.replace(CFG, rules=PAPER))
    d = paper.decide(cluster(ppi=3.0, load=0.27, adm=0.05, n_p=6, n_d=2), 0.0)
    assert (d.action, len(d.worker_ids)) == (D2P, 1)


def test_d2p_never_leaves_fewer_decode_workers_than_the_backlog_needs() -> None:
    # 3 decode workers, 64 slots each, fill target 0.5 → 32 requests per worker.
    # 70 running + waiting need 3 workers: no move at all, whatever the load signals say.
    heavy = DecodeDemand(requests=70, slots_per_worker=64)
    assert move_size(D2P, 9.0, 0.05, 0.05, 5, 3, CFG, demand=heavy) == 0
    # 60 need 2: one worker may go (the PPI gap alone would move 2).
    assert move_size(D2P, 9.0, 0.05, 0.05, 5, 3, CFG, demand=DecodeDemand(60, 64)) == 1
    # Unknown batch limit (slots 0): no backlog bound.
    assert move_size(D2P, 9.0, 0.05, 0.05, 5, 3, CFG, demand=DecodeDemand(70, 0)) == 2
    # decide() reads the backlog off the snapshot: 3 × (20 running + 4 waiting) = 72.
    snap = cluster(ppi=9.0, load=0.05, adm=0.05, n_p=5, n_d=3, running=20, waiting=4)
    assert decode_demand(snap.workers) == DecodeDemand(72, 64)
    d = RolePolicy(CFG).decide(snap, 0.0)
    assert (d.action, d.reason) == (NONE, "decode_headroom")


def test_p2d_is_sized_by_the_decode_backlog() -> None:
    # 7P1D, decode admission saturated and blocking prefill: the DPI_adm gap alone gives
    # ⌈1·1.0/0.375 − 1⌉ = 2 workers; the backlog (64 running + 40 waiting = 104) needs
    # ⌈104/32⌉ = 4 decode workers → 3 more.
    assert move_size(P2D, 9.0, 0.95, 1.0, 7, 1, CFG, decode_blocked=True) == 2
    demand = DecodeDemand(104, 64)
    assert move_size(P2D, 9.0, 0.95, 1.0, 7, 1, CFG, decode_blocked=True, demand=demand) == 3
    snap = cluster(ppi=9.0, load=0.95, adm=1.0, n_p=7, n_d=1, running=64, waiting=40)
    d = RolePolicy(CFG).decide(snap, 0.0)
    assert (d.action, d.reason, len(d.worker_ids)) == (P2D, "decode_admission_blocks_prefill", 3)


def test_saturated_decode_lets_p2d_take_prefill_workers_up_to_ppi_high() -> None:
    # Eq. 23 with DPI̅_adm saturated (demand censored by the full slots): PPI̅ 0.5 on 7
    # prefill workers bounds k by PPI_high (7·0.5/(7−k) < 1.0 → k <= 3), not PPI_low
    # (7·0.5/(7−k) < 0.6 → k <= 1).
    assert move_size(P2D, 0.5, 0.95, 1.0, 7, 1, CFG) == 2  # the adm gap: 2
    assert move_size(P2D, 0.5, 0.95, 1.0, 7, 1, CFG, demand=DecodeDemand(150, 64)) == 3
    assert move_size(P2D, 0.5, 0.3, 0.5, 7, 1, CFG, demand=DecodeDemand(150, 64)) == 1


def test_smoothed_adm_ignores_a_one_interval_spike() -> None:
    calm = cluster(ppi=0.1, load=0.2, adm=0.1, n_p=4, n_d=4)
    spike = cluster(ppi=0.1, load=0.2, adm=1.0, n_p=4, n_d=4)
    policy = RolePolicy(CFG)
    for t in range(4):
        assert policy.decide(calm, float(t)).recommendation == NONE
    d = policy.decide(spike, 4.0)  # median of 0.1 ×4 and 1.0 = 0.1
    assert (d.recommendation, d.action, d.dpi_adm_bar) == (NONE, NONE, pytest.approx(0.1))
    assert policy.decide(calm, 5.0).recommendation == NONE
    # Instantaneous DPI̅_adm (smoothing off) moves on the spike at once (N_persist 1).
    raw = RolePolicy(dataclasses.replace(CFG, adm_smoothing_q=0.0))
    for t in range(4):
        raw.decide(calm, float(t))
    assert raw.decide(spike, 4.0).action == P2D


def test_sustained_saturation_gets_through_the_smoothing() -> None:
    calm = cluster(ppi=0.1, load=0.2, adm=0.1, n_p=4, n_d=4)
    hot = cluster(ppi=0.1, load=0.2, adm=0.6, n_p=4, n_d=4)
    policy = RolePolicy(CFG)
    for t in range(3):
        policy.decide(calm, float(t))
    actions = [policy.decide(hot, float(t)).action for t in range(3, 7)]
    # Window (5 s) at t = 3, 4, 5: the calm samples are still at least half of it (the
    # nearest-rank median is calm); at t = 6 most of the window is hot and decode grows.
    assert actions == [NONE, NONE, NONE, P2D]


def test_d2p_guard_reads_the_larger_of_smoothed_and_instantaneous_adm() -> None:
    # DPI̅_adm was low for the window, but is 0.7 now (above the guard 0.55): a decode
    # pool that is filling up now keeps its workers, even though the median is 0.05.
    low = cluster(ppi=3.0, load=0.05, adm=0.05, n_p=4, n_d=4)
    filling = cluster(ppi=3.0, load=0.05, adm=0.7, n_p=4, n_d=4)
    policy = RolePolicy(dataclasses.replace(CFG, n_persist=3))
    for t in range(4):
        policy.decide(low, float(t))  # persisting, not yet moving
    d = policy.decide(filling, 4.0)
    assert d.recommendation == NONE and d.dpi_adm_bar == pytest.approx(0.05)


def test_paper_rules_read_instantaneous_adm() -> None:
    calm = cluster(ppi=0.1, load=0.2, adm=0.1, n_p=4, n_d=4)
    spike = cluster(ppi=0.1, load=0.2, adm=1.0, n_p=4, n_d=4)
    paper = RolePolicy(dataclasses.replace(CFG, rules=PAPER))
    for t in range(4):
        paper.decide(calm, float(t))
    d = paper.decide(spike, 4.0)
    assert d.dpi_adm_bar == 1.0 and d.action == P2D and len(d.worker_ids) == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"d2p_load_margin": -0.1},
        {"decode_fill_target": 0.0},
        {"decode_fill_target": 1.5},
        {"adm_smoothing_q": 101.0},
        {"n_persist_blocked": 0},
        {"n_persist_blocked": 1.5},
    ],
)
def test_new_fields_are_validated(kwargs: dict[str, float]) -> None:
    with pytest.raises(PolicyConfigError):
        PolicyConfig(**kwargs)  # type: ignore[arg-type]
