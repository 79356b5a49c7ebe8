"""FluidRole rules (eq. 20–23): aggregation, persistence, cooldown, guards, candidate choice."""

from __future__ import annotations

import dataclasses

import pytest

from shared.policy.config import PAPER, PolicyConfig
from shared.policy.errors import PolicyConfigError
from shared.policy.fluidrole import (
    D2P,
    DECODE,
    DRAIN,
    NONE,
    P2D,
    PREFILL,
    ClusterSnapshot,
    RolePolicy,
    WorkerView,
    aggregate_pressure,
)
from shared.policy.window import KeyedWindows, SlidingWindow, nearest_rank_percentile

CFG = PolicyConfig(n_persist=3, cooldown_s=10.0)
PAPER_CFG = dataclasses.replace(CFG, rules=PAPER)


def pw(wid: str, ppi: float, running: int = 0, queue: int = 0, state: str = "active") -> WorkerView:
    return WorkerView(
        wid, PREFILL, state, ppi_p95=ppi, running_prefill_tokens=running, queue_len=queue
    )


def dw(wid: str, load: float, adm: float, active: int = 0, state: str = "active") -> WorkerView:
    return WorkerView(wid, DECODE, state, dpi_load=load, dpi_adm=adm, active_decode_requests=active)


def snap(*workers: WorkerView) -> ClusterSnapshot:
    return ClusterSnapshot(tuple(workers))


# Prefill hot (PPI̅ = max(1.5, 1.2) = 1.5 > 1.0), decode load low (mean 0.15 < 0.6; one
# decode worker left would see 2·0.15 = 0.3 < 0.6 − 0.1 and DPI_adm 2·0.2 = 0.4 < 0.55).
PREFILL_HOT = snap(
    pw("p1", 1.5), pw("p2", 1.2), dw("d1", 0.1, 0.2, active=9), dw("d2", 0.2, 0.2, active=4)
)


def test_percentile_and_sliding_window() -> None:
    # Nearest rank: p95 of 1..20 is the ⌈0.95·20⌉ = 19th smallest = 19.
    assert nearest_rank_percentile([float(v) for v in range(20, 0, -1)], 95) == 19.0
    assert nearest_rank_percentile([3.0], 95) == 3.0
    with pytest.raises(PolicyConfigError):
        nearest_rank_percentile([], 95)
    w = SlidingWindow(5.0)
    for t in range(10):  # values 0..9 at t = 0..9
        w.add(float(t), float(t))
    # At t = 9 the window keeps t >= 4: values 4..9 (6 samples); ⌈0.95·6⌉ = 6th -> 9.
    assert w.values(9.0) == [4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    assert w.p95(9.0) == 9.0
    assert w.percentile(9.0, 50) == 6.0  # ⌈3⌉ = 3rd of 4..9
    assert w.p95(100.0) is None  # everything expired
    kw = KeyedWindows(5.0)
    kw.add("p1", 0.0, 0.4)
    kw.add("p1", 1.0, 1.4)
    assert kw.p95("p1", 1.0) == 1.4 and kw.p95("p2", 1.0) is None


def test_aggregation_eq20_eq21_uses_active_workers_only() -> None:
    workers = (
        pw("p1", 0.7),
        pw("p2", 1.3),
        pw("p3", 9.0, state=DRAIN),
        dw("d1", 0.2, 0.1),
        dw("d2", 0.6, 0.5),
        dw("d3", 1.0, 1.0, state=DRAIN),
    )
    # PPI̅ = max(0.7, 1.3) = 1.3; DPI̅_load = (0.2+0.6)/2 = 0.4; DPI̅_adm = (0.1+0.5)/2 = 0.3.
    assert aggregate_pressure(workers) == pytest.approx((1.3, 0.4, 0.3, 2, 2))


def test_d2p_after_n_persist_intervals_picks_fewest_active_decodes() -> None:
    policy = RolePolicy(CFG)
    d0 = policy.decide(PREFILL_HOT, 0.0)
    d1 = policy.decide(PREFILL_HOT, 1.0)
    assert (d0.action, d0.reason, d0.recommendation) == (NONE, "persisting_1_of_3", D2P)
    assert (d1.action, d1.persist_count) == (NONE, 2)
    d2 = policy.decide(PREFILL_HOT, 2.0)
    assert (d2.action, d2.worker_id, d2.target_role) == (D2P, "d2", PREFILL)  # 4 < 9 active
    assert d2.reason == "eq22_prefill_pressure" and d2.persist_count == 3
    assert (d2.ppi_bar, d2.dpi_load_bar, d2.dpi_adm_bar) == pytest.approx((1.5, 0.15, 0.2))
    assert d2.to_log()["worker_id"] == "d2"


def test_an_interruption_resets_persistence() -> None:
    policy = RolePolicy(CFG)
    calm = snap(pw("p1", 0.8), pw("p2", 0.7), dw("d1", 0.3, 0.1), dw("d2", 0.4, 0.1))
    policy.decide(PREFILL_HOT, 0.0)
    policy.decide(PREFILL_HOT, 1.0)
    assert policy.decide(calm, 2.0).reason == "balanced"
    assert policy.decide(PREFILL_HOT, 3.0).persist_count == 1
    assert policy.decide(PREFILL_HOT, 4.0).action == NONE
    assert policy.decide(PREFILL_HOT, 5.0).action == D2P


def test_cooldown_then_fresh_persistence() -> None:
    policy = RolePolicy(PAPER_CFG)  # the paper's fixed cooldown (ADAPTIVE: see below)
    for t in (0.0, 1.0):
        policy.decide(PREFILL_HOT, t)
    assert policy.decide(PREFILL_HOT, 2.0).action == D2P
    # Pressure goes on, but 2.0 + 10 s of cooldown must pass first.
    for t in range(3, 12):
        d = policy.decide(PREFILL_HOT, float(t))
        assert (d.action, d.reason) == (NONE, "cooldown")
    # At t = 12 counting starts again from 1.
    assert policy.decide(PREFILL_HOT, 12.0).reason == "persisting_1_of_3"
    assert policy.decide(PREFILL_HOT, 13.0).action == NONE
    assert policy.decide(PREFILL_HOT, 14.0).action == D2P


def test_one_switch_at_a_time() -> None:
    policy = RolePolicy(CFG)
    draining = snap(*PREFILL_HOT.workers, dw("d3", 0.1, 0.1, state=DRAIN))
    for t in range(6):
        d = policy.decide(draining, float(t))
        assert (d.action, d.reason) == (NONE, "switch_in_progress")


def test_never_empty_a_role() -> None:
    policy = RolePolicy(CFG)
    lone_decode = snap(pw("p1", 1.5), pw("p2", 1.2), dw("d1", 0.3, 0.5))
    reasons = [policy.decide(lone_decode, float(t)).reason for t in range(5)]
    assert reasons[:2] == ["persisting_1_of_3", "persisting_2_of_3"]
    assert reasons[2:] == ["would_empty_role"] * 3
    lone_prefill = snap(pw("p1", 0.2), dw("d1", 0.3, 0.5), dw("d2", 0.3, 0.5))
    policy = RolePolicy(CFG)
    assert all(policy.decide(lone_prefill, float(t)).action == NONE for t in range(5))


def test_both_phases_pressured_means_no_switch() -> None:
    policy = RolePolicy(CFG)
    # PPI̅ 1.5 > 1.0 but DPI̅_load = 0.8 >= 0.6: eq. 22 fails; eq. 23 needs PPI̅ < 0.6.
    # DPI̅_adm = 0.5: admission still has headroom, so it is not decode backpressure.
    both = snap(pw("p1", 1.5), pw("p2", 1.1), dw("d1", 0.8, 0.5), dw("d2", 0.8, 0.5))
    for t in range(6):
        d = policy.decide(both, float(t))
        assert (d.action, d.reason, d.recommendation) == (NONE, "both_phases_pressured", NONE)


def test_saturated_decode_admission_blocking_prefill_recommends_p2d() -> None:
    """Extension: PPI̅ high because the decode pool admits nothing (DPI̅_adm 0.95 >= 0.9)."""
    blocked = snap(
        pw("p1", 1.5, queue=40), pw("p2", 1.1, queue=30), dw("d1", 0.8, 0.95), dw("d2", 0.8, 0.95)
    )
    # n_persist_blocked intervals (the smoothed DPI̅_adm already needs half its window
    # saturated): 3 here, as N_persist ...
    policy = RolePolicy(dataclasses.replace(CFG, n_persist_blocked=3))
    decisions = [policy.decide(blocked, float(t)) for t in range(3)]
    assert [d.recommendation for d in decisions] == [P2D, P2D, P2D]
    assert decisions[-1].reason == "decode_admission_blocks_prefill"
    assert [d.action for d in decisions] == [NONE, NONE, P2D]
    # ... and 1 by default: the first interval that sees it moves.
    d = RolePolicy(CFG).decide(blocked, 0.0)
    assert (d.action, d.reason) == (P2D, "decode_admission_blocks_prefill")


def test_no_d2p_while_decode_admission_is_short() -> None:
    """Extension: eq. 22 holds (PPI̅ > 1, DPI̅_load < 0.6) but DPI̅_adm = 0.7 is above the
    hysteresis bound (0.2 + 0.9) / 2 = 0.55: removing a decode worker would deepen the
    backpressure, so no D->P."""
    policy = RolePolicy(CFG)
    s = snap(pw("p1", 1.5), pw("p2", 1.2), dw("d1", 0.3, 0.7), dw("d2", 0.3, 0.7))
    assert policy.decide(s, 0.0).recommendation == NONE


def test_p2d_picks_least_running_prefill_and_hysteresis_band() -> None:
    policy = RolePolicy(CFG)
    # DPI̅_adm = 0.5 > 0.2 and PPI̅ = 0.4 < 0.6: eq. 23.
    decode_hot = snap(
        pw("p1", 0.4, running=2000, queue=1),
        pw("p2", 0.3, running=500, queue=3),
        pw("p3", 0.1, running=500, queue=2),
        dw("d1", 0.5, 0.5),
        dw("d2", 0.5, 0.5),
    )
    actions = [policy.decide(decode_hot, float(t)) for t in range(3)]
    assert [a.action for a in actions] == [NONE, NONE, P2D]
    # Least running work 500 (p2, p3), then the shorter queue: p3.
    assert (actions[2].worker_id, actions[2].target_role) == ("p3", DECODE)
    assert actions[2].reason == "eq23_decode_admission_pressure"
    # PPI̅ = 0.8 in [PPI_low, PPI_high]: decode is pressured but prefill is not idle.
    band = snap(pw("p1", 0.8), pw("p2", 0.3), dw("d1", 0.5, 0.5), dw("d2", 0.5, 0.5))
    policy = RolePolicy(CFG)
    assert {policy.decide(band, float(t)).reason for t in range(5)} == {"prefill_not_idle"}


def test_ties_break_on_worker_id_and_pause() -> None:
    tied = snap(pw("p1", 1.5), dw("dB", 0.1, 0.1, active=2), dw("dA", 0.1, 0.1, active=2))
    policy = RolePolicy(dataclasses.replace(CFG, n_persist=1))
    assert policy.decide(tied, 0.0).worker_id == "dA"
    paused = RolePolicy(dataclasses.replace(CFG, n_persist=1))
    paused.paused = True
    assert paused.decide(tied, 0.0).reason == "paused"
    paused.paused = False
    assert paused.decide(tied, 1.0).action == D2P
