"""FluidRole's ADAPTIVE rules (issue 16 item 3): moves sized by the distance from balance,
settle-time hysteresis before the next move, a longer guard against moving back, and the
PAPER rule set kept selectable (eq. 22 literally, no DPI_adm guard, one worker, cooldown)."""

from __future__ import annotations

import dataclasses

import pytest

from services.bench.shift_analysis import recommendation
from shared.policy.config import ADAPTIVE, PAPER, PolicyConfig
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
)
from shared.policy.fluidrole_sizing import move_size
from tests.support.role_views import waiting_decode

# reverse_wait_s 8 s (the default is 4 s): the reverse wait's tests need it longer than
# reverse_wait_binds_s (4 s) and than the DPI_adm window's lag.
CFG = PolicyConfig(
    n_persist=1, cooldown_s=20.0, settle_s=6.0, max_move_workers=3, reverse_wait_s=8.0
)


def pw(wid: str, ppi: float, state: str = "active") -> WorkerView:
    return WorkerView(wid, PREFILL, state, ppi_p95=ppi)


def dw(wid: str, load: float, adm: float, active: int = 0, state: str = "active") -> WorkerView:
    return WorkerView(wid, DECODE, state, dpi_load=load, dpi_adm=adm, active_decode_requests=active)


def cluster(ppi: float, load: float, adm: float, n_p: int = 4, n_d: int = 4) -> ClusterSnapshot:
    return ClusterSnapshot(
        tuple(pw(f"p{i}", ppi) for i in range(n_p))
        + tuple(dw(f"d{i}", load, adm, active=i) for i in range(n_d))
    )


def test_move_size_grows_with_the_gap_and_respects_the_other_phase() -> None:
    # 4P, PPI̅ 1.1: 4·1.1/0.8 − 4 = 1.5 → 2 workers; PPI̅ 3.0 → 11 → capped at 3.
    assert move_size(D2P, 1.1, 0.1, 0.1, 4, 4, CFG) == 2
    assert move_size(D2P, 3.0, 0.1, 0.1, 4, 4, CFG) == 3
    # The decode side must stay below DPI_load^high: 4·0.35/(4−k) < 0.6 → k <= 1.
    assert move_size(D2P, 3.0, 0.35, 0.1, 4, 4, CFG) == 1
    # P→D: adm 0.6 over 4D, middle of the band (0.2 + 0.55)/2 = 0.375 → 4·0.6/0.375 − 4 = 2.4.
    assert move_size(P2D, 0.1, 0.1, 0.6, 4, 4, CFG) == 3
    # Prefill must stay below PPI_low: 4·0.3/(4−k) < 0.6 → k <= 1.
    assert move_size(P2D, 0.3, 0.1, 0.6, 4, 4, CFG) == 1
    # Never the whole source role.
    assert move_size(D2P, 9.0, 0.0, 0.0, 1, 2, CFG) == 1
    assert move_size(D2P, 9.0, 0.0, 0.0, 1, 1, CFG) == 0


def test_a_large_gap_moves_several_workers_in_one_decision() -> None:
    policy = RolePolicy(CFG)
    d = policy.decide(cluster(ppi=2.0, load=0.1, adm=0.1), 0.0)
    assert d.action == D2P and len(d.worker_ids) == 3
    assert d.worker_ids == ("d0", "d1", "d2")  # fewest active decodes first
    assert d.worker_id == "d0" and d.target_role == PREFILL


def test_settle_after_the_switch_completes_then_move_again_same_way() -> None:
    policy = RolePolicy(CFG)
    hot = cluster(ppi=1.1, load=0.1, adm=0.1)
    assert policy.decide(hot, 0.0).action == D2P
    in_transit = ClusterSnapshot((*hot.workers[:-1], dw("d3", 0.1, 0.1, state=DRAIN)))
    for t in (1.0, 2.0, 3.0):  # the switch takes 3 s
        assert policy.decide(in_transit, t).reason == "switch_in_progress"
    # Done at ~3 s: the same move waits settle_s = 6 s from the last transit seen (3 s).
    for t in (4.0, 6.0, 8.5):
        assert (policy.decide(hot, t).action, policy.decide(hot, t).reason) == (NONE, "settling")
    assert policy.decide(hot, 9.0).action == D2P  # not the 20 s cooldown


def test_moving_back_waits_the_reverse_wait() -> None:
    policy = RolePolicy(CFG)
    assert CFG.reverse_wait_s == 8.0 and CFG.cooldown_s == 20.0  # PAPER's, not used here
    assert policy.decide(cluster(ppi=1.1, load=0.1, adm=0.1), 0.0).action == D2P
    decode_hot = cluster(ppi=0.1, load=0.3, adm=0.6)
    # DPI̅_adm is the median of the last window_s (5 s) of decisions: at t = 1 the window
    # still holds t = 0's 0.1, so the move back is not even recommended yet.
    assert policy.decide(decode_hot, 1.0).recommendation == NONE
    for t in (2.0, 5.0, 7.5):
        d = policy.decide(decode_hot, t)
        assert (d.action, d.reason, d.recommendation) == (NONE, "cooldown", P2D)
    assert policy.decide(decode_hot, 8.0).action == P2D
    # The wait counts from the last moment a worker was seen in transit, not the decision.
    policy = RolePolicy(CFG)
    hot = cluster(ppi=1.1, load=0.1, adm=0.1)
    assert policy.decide(hot, 0.0).action == D2P
    in_transit = ClusterSnapshot((*hot.workers[:-1], dw("d3", 0.1, 0.1, state=DRAIN)))
    assert policy.decide(in_transit, 4.0).reason == "switch_in_progress"
    assert policy.decide(decode_hot, 5.0).recommendation == NONE  # the median still 0.1
    for t in (8.0, 11.5):
        assert policy.decide(decode_hot, t).reason == "cooldown"
    assert policy.decide(decode_hot, 12.0).action == P2D


def test_paper_rules_are_eq22_literally_one_worker_and_no_adm_extensions() -> None:
    paper = RolePolicy(dataclasses.replace(CFG, rules=PAPER))
    adaptive = RolePolicy(CFG)
    # DPI̅_adm 0.7 is above ADAPTIVE's guard: ADAPTIVE holds, the paper takes a worker.
    short = cluster(ppi=2.0, load=0.3, adm=0.7)
    assert adaptive.decide(short, 0.0).recommendation == NONE
    d = paper.decide(short, 0.0)
    assert d.action == D2P and d.worker_ids == ("d0",) and d.reason == "eq22_prefill_pressure"
    # Both phases pressured with decode admission saturated: ADAPTIVE adds decode, the paper
    # does nothing.
    blocked = cluster(ppi=2.0, load=0.8, adm=0.95)
    assert RolePolicy(CFG).decide(blocked, 0.0).action == P2D
    d = RolePolicy(dataclasses.replace(CFG, rules=PAPER)).decide(blocked, 0.0)
    assert (d.action, d.reason) == (NONE, "both_phases_pressured")
    # The paper's fixed cooldown from the decision, also for the same direction.
    hot = cluster(ppi=1.1, load=0.1, adm=0.1)
    p = RolePolicy(dataclasses.replace(CFG, rules=PAPER))
    assert p.decide(hot, 0.0).action == D2P
    assert p.decide(hot, 19.0).reason == "cooldown"
    assert p.decide(hot, 20.0).action == D2P


def test_rule_set_is_validated() -> None:
    assert PolicyConfig().rules == ADAPTIVE
    with pytest.raises(PolicyConfigError):
        PolicyConfig(rules="aggressive")
    with pytest.raises(PolicyConfigError):
        PolicyConfig(max_move_workers=0)
    with pytest.raises(PolicyConfigError):
        PolicyConfig(settle_s=-1.0)
    assert PolicyConfig.from_dict({"rules": "paper"}).rules == PAPER


def test_decode_blocking_prefill_moves_by_the_decode_gap() -> None:
    # 7P1D with the one decode worker's admission saturated: the prefill backlog is decode
    # backpressure, so PPI̅ does not bound the move (it would allow none); the decode gap
    # 1·1.0/0.375 − 1 = 1.67 → 2 workers.
    assert move_size(P2D, 3.0, 0.9, 1.0, 7, 1, CFG) == 1  # bounded by PPI̅ otherwise
    assert move_size(P2D, 3.0, 0.9, 1.0, 7, 1, CFG, decode_blocked=True) == 2
    policy = RolePolicy(CFG)
    d = policy.decide(cluster(ppi=3.0, load=0.9, adm=1.0, n_p=7, n_d=1), 0.0)
    assert (d.action, d.reason) == (P2D, "decode_admission_blocks_prefill")
    assert len(d.worker_ids) == 2 and d.target_role == DECODE


def test_a_drained_prefill_queue_lets_decode_take_workers_back_despite_the_window() -> None:
    # Eq. 20's window still holds the code stage's peak (PPI^95 1.45) while the queues have
    # drained (latest PPI 0) and the one decode worker runs at its TPOT-safe limit.
    def drained(ppi_now: float | None) -> ClusterSnapshot:
        prefill = [WorkerView(f"p{i}", PREFILL, ppi_p95=1.45, ppi_now=ppi_now) for i in range(7)]
        return ClusterSnapshot((*prefill, dw("d0", load=1.0, adm=0.1), dw("d1", load=1.0, adm=0.1)))

    stale = RolePolicy(CFG).decide(drained(None), 0.0)  # not reported: the window decides
    assert (stale.action, stale.reason) == (NONE, "both_phases_pressured")
    d = RolePolicy(CFG).decide(drained(0.0), 0.0)
    assert (d.action, d.reason) == (P2D, "decode_load_pressure")
    assert d.worker_ids == ("p0",) and d.ppi_bar == 1.45  # the published PPI̅ stays eq. 20's
    # PAPER reads eq. 20 only.
    paper = RolePolicy(dataclasses.replace(CFG, rules=PAPER)).decide(drained(0.0), 0.0)
    assert (paper.action, paper.reason) == (NONE, "both_phases_pressured")
    # The latest PPI never starts a move to prefill: that still needs the windowed PPI̅.
    spike = ClusterSnapshot(
        tuple(WorkerView(f"p{i}", PREFILL, ppi_p95=0.1, ppi_now=3.0) for i in range(4))
        + tuple(dw(f"d{i}", load=0.1, adm=0.1) for i in range(4))
    )
    assert RolePolicy(CFG).decide(spike, 0.0).action == NONE


def test_moving_back_while_decode_binds_waits_the_shorter_reverse_wait() -> None:
    assert (CFG.reverse_wait_s, CFG.reverse_wait_binds_s) == (8.0, 4.0)

    def after_the_move(waiting: int) -> ClusterSnapshot:
        # 5P3D after a D->P move; every decode slot is taken and `waiting` more per worker
        # wait for admission.
        decode = waiting_decode((waiting,) * 3, load=1.0)
        return ClusterSnapshot(tuple(pw(f"p{i}", 0.1) for i in range(5)) + decode)

    for waiting, first_move_s in ((20, 4.0), (0, 8.0)):  # decode binds / full but not short
        policy = RolePolicy(CFG)
        assert policy.decide(cluster(ppi=1.1, load=0.1, adm=0.1), 0.0).action == D2P
        back = after_the_move(waiting)
        moves = {t: policy.decide(back, t) for t in (2.0, 3.5, 4.0, 6.0, 7.5, 8.0)}
        first = min(t for t, d in moves.items() if d.action == P2D)
        assert first == first_move_s, (waiting, {t: d.reason for t, d in moves.items()})
        assert all(moves[t].reason == "cooldown" for t in moves if t < first_move_s)


def test_a_decisions_published_inputs_give_its_recommendation_again() -> None:
    # A fresh DPI_adm spike (0.8, above the D->P guard, below the blocking level) under a
    # window whose percentile is still 0: the guard reads the spike, so no D->P. bench shift
    # re-derives each recommendation from the published inputs alone (shift_analysis).
    policy = RolePolicy(CFG)
    for t, adm in ((0.0, 0.0), (1.0, 0.0), (2.0, 0.8)):
        d = policy.decide(cluster(ppi=3.0, load=0.3, adm=adm), t)
    assert d.dpi_adm_bar == 0.0 and d.dpi_adm_guard == pytest.approx(0.8)
    assert (d.recommendation, d.reason) == (NONE, "both_phases_pressured")
    inputs = d.inputs(8)
    assert inputs["dpi_adm_guard"] == pytest.approx(0.8) and inputs["workers"] == 8.0
    assert recommendation(inputs, CFG) == d.recommendation
    # Without the guard's value the same inputs read as eq. 22: the field is what agrees.
    del inputs["dpi_adm_guard"]
    assert recommendation(inputs, CFG) == D2P
    # PAPER has no guard and publishes none.
    paper = RolePolicy(dataclasses.replace(CFG, rules=PAPER)).decide(cluster(3.0, 0.3, 0.8), 0.0)
    assert paper.dpi_adm_guard is None and "dpi_adm_guard" not in paper.inputs(8)


def test_a_follow_up_move_back_to_decode_counts_its_persistence_while_settling() -> None:
    # Decode admission pressure holds after a P->D move: the follow-up P->D move fires as
    # settle_s ends, its n_persist intervals counted during the settle (the return to decode
    # at a stage edge needs several moves; each used to cost settle_s + n_persist). A
    # follow-up D->P still counts from the end of the settle.
    cfg = dataclasses.replace(CFG, n_persist=3, max_move_workers=1)
    assert cfg.p2d_persist_while_settling

    def moves(cfg: PolicyConfig, snap: ClusterSnapshot) -> list[float]:
        policy = RolePolicy(cfg)
        return [t for t in range(14) if policy.decide(snap, float(t)).switches]

    p2d = cluster(ppi=0.0, load=0.3, adm=0.5, n_p=6, n_d=2)
    assert RolePolicy(cfg).decide(p2d, 0.0).recommendation == P2D
    # The first move after 3 intervals (t = 2), the settle until t = 8, the next at once.
    assert moves(cfg, p2d) == [2, 8]
    off = dataclasses.replace(cfg, p2d_persist_while_settling=False)
    assert moves(off, p2d)[:2] == [2, 10]
    d2p = cluster(ppi=3.0, load=0.1, adm=0.0, n_p=4, n_d=4)
    assert RolePolicy(cfg).decide(d2p, 0.0).recommendation == D2P
    assert moves(cfg, d2p)[:2] == [2, 10]
    # PAPER: one cooldown, persistence counted after it.
    paper = dataclasses.replace(cfg, rules=PAPER)
    assert moves(paper, p2d) == [2]


def test_p2d_persist_while_settling_must_be_a_bool() -> None:
    with pytest.raises(PolicyConfigError, match="p2d_persist_while_settling"):
        PolicyConfig(p2d_persist_while_settling=1)  # type: ignore[arg-type]
    doc = PolicyConfig(p2d_persist_while_settling=False).to_dict()
    assert PolicyConfig.from_dict(doc).p2d_persist_while_settling is False


def test_a_move_back_to_decode_while_decode_binds_needs_no_persistence() -> None:
    # 7P1D after a late D->P at a stage edge: the one decode worker's 64 slots are taken and
    # `waiting` more wait for admission. While decode binds (backlog over every slot) a P->D
    # fires on the first interval its wait allows; a full decode that does not bind, and
    # PAPER, still count n_persist intervals.
    cfg = dataclasses.replace(CFG, n_persist=3, max_move_workers=1)
    assert cfg.n_persist_binds == 1

    def saturated(waiting: int) -> ClusterSnapshot:
        return ClusterSnapshot(
            (*(pw(f"p{i}", 0.1) for i in range(7)), *waiting_decode((waiting,), load=1.0))
        )

    def moves(cfg: PolicyConfig, snap: ClusterSnapshot) -> list[int]:
        # The first move only: the snapshot stays as it is, and a follow-up while decode
        # binds does not settle (tests/test_policy_fluidrole_stage_edge.py).
        policy = RolePolicy(cfg)
        return [t for t in range(4) if policy.decide(snap, float(t)).switches][:1]

    assert moves(cfg, saturated(30)) == [0]  # binds: at once
    assert moves(cfg, saturated(0)) == [2]  # full, not short: 3 intervals
    assert moves(dataclasses.replace(cfg, n_persist_binds=3), saturated(30)) == [2]
    assert moves(dataclasses.replace(cfg, rules=PAPER), saturated(30)) == [2]
    with pytest.raises(PolicyConfigError, match="n_persist_binds"):
        PolicyConfig(n_persist_binds=0)


def test_a_d2p_move_its_bounds_cut_short_is_followed_without_settling() -> None:
    # PPI̅ 3.0 on 4P asks for max_move_workers (2); at DPI̅_load 0.35 the decode load bound
    # lets one go (4·0.35/(4−k) < 0.6). Once the decode backlog drains (load 0.1) the rest
    # follows at the next decision, not after settle_s; a move of the whole gap settles.
    cfg = dataclasses.replace(CFG, n_persist=1, max_move_workers=2)
    assert cfg.d2p_follow_shortfall

    def run(cfg: PolicyConfig, first_load: float) -> tuple[int, list[int]]:
        policy = RolePolicy(cfg)
        first = policy.decide(cluster(ppi=3.0, load=first_load, adm=0.1), 0.0)
        moved = len(first.worker_ids)
        after = cluster(ppi=3.0, load=0.1, adm=0.1, n_p=4 + moved, n_d=4 - moved)
        return moved, [t for t in range(1, 9) if policy.decide(after, float(t)).switches][:1]

    assert run(cfg, 0.35) == (1, [1])  # cut short by the decode load bound: at once
    assert run(dataclasses.replace(cfg, d2p_follow_shortfall=False), 0.35) == (1, [6])
    assert run(cfg, 0.1) == (2, [6])  # the whole (capped) gap moved: it settles
    with pytest.raises(PolicyConfigError, match="d2p_follow_shortfall"):
        PolicyConfig(d2p_follow_shortfall=1)  # type: ignore[arg-type]
