"""FluidRole's decode flow forecast (shared/policy/decode_flow.py) and how move sizing reads
it: Little's law N̄ · λ_in / λ_out over a window from the workers' cumulative counters, and
a D→P move refused while decode is still filling although its backlog now is small. Pure
functions, no processes."""

from __future__ import annotations

import pytest

from shared.policy.config import PolicyConfig
from shared.policy.decode_flow import DecodeFlow, DecodeFlowMeter, FlowCounters
from shared.policy.errors import PolicyConfigError
from shared.policy.fluidrole import (
    D2P,
    DECODE,
    NONE,
    PREFILL,
    ClusterSnapshot,
    Decision,
    RolePolicy,
    WorkerView,
)
from shared.policy.fluidrole_sizing import DecodeDemand, move_size

CFG = PolicyConfig(n_persist=1)


def test_steady_flow_forecasts_the_backlog_and_a_filling_one_more() -> None:
    assert DecodeFlow(entered=50, left=50, mean_backlog=40).requests == pytest.approx(40)
    # Twice as many entered as left: where the backlog settles is twice its mean.
    assert DecodeFlow(entered=100, left=50, mean_backlog=40).requests == pytest.approx(80)
    # Draining (fewer in than out) forecasts less; nothing entered: the backlog as it is.
    assert DecodeFlow(entered=25, left=50, mean_backlog=40).requests == pytest.approx(20)
    assert DecodeFlow(entered=0, left=50, mean_backlog=40).requests == pytest.approx(40)
    # Nothing has left yet, or the ratio is extreme: capped at max_ratio.
    assert DecodeFlow(entered=30, left=0, mean_backlog=10).requests == pytest.approx(40)
    assert DecodeFlow(entered=900, left=1, mean_backlog=10, max_ratio=3).requests == 30


def test_a_draining_flow_forecasts_no_more_than_the_backlog_now() -> None:
    # More left than entered: the backlog falls, so the window's mean (which still holds the
    # earlier, larger backlog) times the ratio over-states where it goes: the backlog now caps it.
    assert DecodeFlow(entered=40, left=50, mean_backlog=90, backlog_now=20).requests == 20
    assert DecodeFlow(entered=0, left=50, mean_backlog=40, backlog_now=3).requests == 3
    # Below the backlog now the forecast stands; a filling flow is never capped by it.
    assert DecodeFlow(entered=25, left=50, mean_backlog=40, backlog_now=30).requests == 20
    assert DecodeFlow(entered=100, left=50, mean_backlog=40, backlog_now=10).requests == 80
    assert DecodeFlow(entered=50, left=50, mean_backlog=40, backlog_now=10).requests == 40


def test_meter_sums_increments_per_worker_and_windows_them() -> None:
    meter = DecodeFlowMeter(window_s=10.0)
    # First reports only set baselines (their history is not this window's flow).
    meter.observe("d0", FlowCounters(entered=500, left=480))
    meter.observe("d1", FlowCounters(entered=7, left=7))
    assert meter.sample(0.0, backlog=20) == DecodeFlow(0, 0, 20, 4.0, backlog_now=20)
    meter.observe("d0", FlowCounters(entered=530, left=490))
    meter.observe("d1", FlowCounters(entered=17, left=12))
    flow = meter.sample(5.0, backlog=40)
    assert (flow.entered, flow.left, flow.mean_backlog) == (40, 15, 30)
    # d1 restarted (its counters start again at 0): the negative step reads as 0.
    meter.observe("d1", FlowCounters(entered=3, left=1))
    meter.observe("d0", FlowCounters(entered=540, left=510))
    flow = meter.sample(10.0, backlog=30)
    assert (flow.entered, flow.left, flow.mean_backlog) == (50, 35, 30)
    # The window moves on: at 15.5 s it starts at the newest sample at or before 5.5 s.
    meter.observe("d0", FlowCounters(entered=550, left=530))
    flow = meter.sample(15.5, backlog=10)
    # From the 5 s sample: entered 50 + 10 − 40, left 35 + 20 − 15; backlog (40+30+10)/3.
    assert (flow.entered, flow.left) == (20, 40)
    assert flow.mean_backlog == pytest.approx(80 / 3)
    with pytest.raises(PolicyConfigError):
        DecodeFlowMeter(window_s=0.0)
    with pytest.raises(PolicyConfigError):
        PolicyConfig(decode_flow_window_s=-1.0)


def test_d2p_bound_reads_the_forecast_scaled_for_the_prefill_it_adds() -> None:
    # 4P4D, 64 slots at the 0.75 fill target = 48 per decode worker. 60 in decode now need 2
    # workers: the PPI gap (⌈4·2/0.8 − 4⌉ = 6) is capped at 3 by the config.
    now_only = DecodeDemand(requests=60, slots_per_worker=64)
    assert move_size(D2P, 2.0, 0.1, 0.05, 4, 4, CFG, demand=now_only) == 2
    # Decode is filling: it settles at 100. One move makes 5P: 125 → 3 workers needed (3 ok);
    # two moves make 6P: 150 → 4 needed, 2 left. So one worker moves.
    filling = DecodeDemand(requests=60, slots_per_worker=64, forecast_requests=100.0)
    assert move_size(D2P, 2.0, 0.1, 0.05, 4, 4, CFG, demand=filling) == 1
    # Settling at 150: even one move (187.5 → 4 needed, 3 left) is refused.
    heavy = DecodeDemand(requests=60, slots_per_worker=64, forecast_requests=150.0)
    assert move_size(D2P, 2.0, 0.1, 0.05, 4, 4, CFG, demand=heavy) == 0


def _cluster(
    running: int, entered: float = 0.0, left: float = 0.0, dpi_adm: float = 0.05
) -> ClusterSnapshot:
    prefill = tuple(WorkerView(f"p{i}", PREFILL, ppi_p95=2.0) for i in range(4))
    decode = tuple(
        WorkerView(
            f"d{i}",
            DECODE,
            dpi_load=0.1,
            dpi_adm=dpi_adm,
            active_decode_requests=running,
            max_decode_requests=64,
            decode_counters=FlowCounters(entered, left),
        )
        for i in range(4)
    )
    return ClusterSnapshot(prefill + decode)


def test_decide_refuses_a_d2p_move_while_decode_fills() -> None:
    snap = _cluster(running=15)  # 60 in decode now
    d = RolePolicy(CFG).decide(snap, 0.0)
    assert (d.action, len(d.worker_ids)) == (D2P, 2)
    # The same cluster, with its flow: 4x as many entered decode as left over the window
    # (100 / 25 per decode worker between a baseline decision, paused, and this one).
    filling = _cluster(running=15, entered=100.0, left=25.0)

    def after_baseline(cfg: PolicyConfig) -> Decision:
        policy = RolePolicy(cfg)
        policy.paused = True
        policy.decide(snap, 0.0)  # counters at 0: the meter's baseline
        policy.paused = False
        return policy.decide(filling, 1.0)

    d = after_baseline(CFG)
    assert d.decode_flow == DecodeFlow(entered=400, left=100, mean_backlog=60, backlog_now=60)
    assert (d.recommendation, d.action, d.reason) == (D2P, NONE, "decode_headroom")
    # With the forecast off in the config, the flow is ignored.
    d = after_baseline(PolicyConfig(n_persist=1, decode_flow_window_s=0.0))
    assert (d.action, len(d.worker_ids)) == (D2P, 2)


def test_decide_sizes_a_d2p_move_by_where_a_draining_decode_is_going() -> None:
    """A stage edge: decode held 160 requests a second ago and drains (40 in, 50 out per
    worker), 20 remain. The window's mean backlog (90) times the ratio (0.8) would forecast
    72 and allow one move (90 at 5P needs 2 of 3 decode workers; 2 moves need 3 of 2); the
    backlog now caps the forecast at 20, and the PPI gap's whole move (capped at 3) goes."""
    policy = RolePolicy(CFG)
    policy.paused = True
    policy.decide(_cluster(running=40, dpi_adm=0.01), 0.0)  # the meter's baseline
    policy.paused = False
    d = policy.decide(_cluster(running=5, entered=40.0, left=50.0, dpi_adm=0.01), 1.0)
    assert d.decode_flow == DecodeFlow(entered=160, left=200, mean_backlog=90, backlog_now=20)
    assert d.decode_flow.requests == 20
    assert (d.action, d.worker_ids) == (D2P, ("d0", "d1", "d2"))
    uncapped = DecodeDemand(requests=20, slots_per_worker=64, forecast_requests=72.0)
    assert move_size(D2P, 2.0, 0.1, 0.01, 4, 4, CFG, demand=uncapped) == 1
