"""FluidRole (ADAPTIVE) P→D bounds on the prefill side and censored decode demand: a P→D move
must leave the prefill workers' predicted busy fraction (shared/policy/busy.py) below
``p2d_busy_bound``; when full batch slots censor DPI̅_adm at 1 the move is sized by the decode
backlog, not by the DPI̅_adm gap. Pure functions, no processes."""

from __future__ import annotations

import dataclasses

import pytest

from shared.policy.busy import BusyClock, BusyMeter
from shared.policy.config import PolicyConfig
from shared.policy.errors import PolicyConfigError
from shared.policy.fluidrole import (
    DECODE,
    NONE,
    P2D,
    PREFILL,
    ClusterSnapshot,
    RolePolicy,
    WorkerView,
    prefill_busy_mean,
)
from shared.policy.fluidrole_sizing import DecodeDemand, move_size

CFG = PolicyConfig(n_persist=1)  # defaults: busy bound 0.85, fill target 0.75


def snapshot(busy: float, n_p: int, n_d: int, running: int, ppi: float = 0.2) -> ClusterSnapshot:
    prefill = tuple(
        WorkerView(f"p{i}", PREFILL, ppi_p95=ppi, prefill_busy_frac=busy) for i in range(n_p)
    )
    decode = tuple(
        WorkerView(
            f"d{i}",
            DECODE,
            dpi_load=0.9,
            dpi_adm=1.0,
            active_decode_requests=running,
            max_decode_requests=64,
        )
        for i in range(n_d)
    )
    return ClusterSnapshot(prefill + decode)


def test_busy_meter_is_the_slope_of_busy_seconds_over_the_window() -> None:
    meter = BusyMeter(window_s=5.0)
    assert meter.fraction() == 0.0  # one sample or none: unknown, reads as idle
    busy = 0.0
    for t in range(11):  # busy 0.4 s of every second
        meter.sample(float(t), busy)
        busy += 0.4
    assert meter.fraction() == pytest.approx(0.4)
    for t in range(11, 17):  # then idle: after a window the old rate is forgotten
        meter.sample(float(t), busy)
    assert meter.fraction() == pytest.approx(0.0)
    meter.sample(17.0, busy + 5.0)  # a clock jump cannot report more than 1
    assert meter.fraction() <= 1.0
    with pytest.raises(PolicyConfigError):
        BusyMeter(window_s=0.0)


def test_busy_clock_counts_closed_periods_and_the_open_ones_share() -> None:
    clock = BusyClock()
    assert clock.total_s(5.0) == 0.0
    clock.start(1.0)
    assert clock.total_s(1.5) == pytest.approx(0.5)  # the running period counts
    clock.stop(2.0)
    clock.stop(9.0)  # no period open: nothing added
    assert clock.total_s(9.0) == pytest.approx(1.0)
    clock.start(10.0)
    assert clock.total_s(12.0) == pytest.approx(3.0)


def test_p2d_leaves_prefill_below_its_busy_bound() -> None:
    demand = DecodeDemand(requests=192 + 60, slots_per_worker=64)  # needs 6 decode workers
    # 5 prefill workers 60 % busy: 3.0 / (5 − k) < 0.85 → k <= 1 (k = 2 predicts 1.0).
    assert move_size(P2D, 0.2, 0.9, 1.0, 5, 3, CFG, demand=demand, prefill_busy=0.6) == 1
    # Mostly idle prefill (20 %) gives what the backlog needs, up to the cap.
    assert move_size(P2D, 0.2, 0.9, 1.0, 5, 3, CFG, demand=demand, prefill_busy=0.2) == 3
    # 75 % busy: even one worker would push the rest to 0.94 → no move while the backlog
    # fits the decode slots (150 <= 3 × 64; it needs 5 workers at the 0.5 fill target) ...
    within = DecodeDemand(requests=150, slots_per_worker=64)
    assert move_size(P2D, 0.2, 0.9, 1.0, 5, 3, CFG, demand=within, prefill_busy=0.75) == 0
    # ... but 252 exceed every slot: decode binds, one worker moves (not the gap of 3).
    assert move_size(P2D, 0.2, 0.9, 1.0, 5, 3, CFG, demand=demand, prefill_busy=0.75) == 1
    # So does a backlog within the slots whose flow forecast exceeds them.
    ramp = DecodeDemand(requests=150, slots_per_worker=64, forecast_requests=200.0)
    assert move_size(P2D, 0.2, 0.9, 1.0, 5, 3, CFG, demand=ramp, prefill_busy=0.75) == 1
    # The bound off (0): the backlog sizes the move alone.
    off = dataclasses.replace(CFG, p2d_busy_bound=0.0)
    assert move_size(P2D, 0.2, 0.9, 1.0, 5, 3, off, demand=demand, prefill_busy=0.75) == 3


def test_decide_says_prefill_headroom_when_no_prefill_worker_can_go() -> None:
    busy = snapshot(busy=0.8, n_p=5, n_d=3, running=64)
    d = RolePolicy(CFG).decide(busy, 0.0)
    assert (d.recommendation, d.action, d.reason) == (P2D, NONE, "prefill_headroom")
    assert prefill_busy_mean(busy.workers) == pytest.approx(0.8)
    idle = snapshot(busy=0.3, n_p=5, n_d=3, running=64)
    d = RolePolicy(CFG).decide(idle, 0.0)
    assert d.action == P2D and len(d.worker_ids) >= 1


def test_censored_adm_sizes_p2d_by_the_backlog_not_the_gap() -> None:
    # DPI̅_adm 1.0 (slots full) on 3 decode workers: the gap alone asks ⌈3·1.0/0.375 − 3⌉ = 5;
    # the backlog, 192 running + 10 waiting at 48 per worker, needs 5 workers → 2 more.
    demand = DecodeDemand(requests=202, slots_per_worker=64)
    assert move_size(P2D, 0.2, 0.9, 1.0, 5, 3, CFG, demand=demand) == 2
    # Below saturation the larger of the two still applies (0.5: gap ⌈3·0.5/0.375 − 3⌉ = 1).
    assert move_size(P2D, 0.2, 0.5, 0.5, 5, 3, CFG, demand=DecodeDemand(100, 64)) == 1


def test_busy_bound_is_validated() -> None:
    with pytest.raises(PolicyConfigError):
        PolicyConfig(p2d_busy_bound=1.5)
    with pytest.raises(PolicyConfigError):
        PolicyConfig(p2d_busy_bound=-0.1)
    assert PolicyConfig(p2d_busy_bound=0.0).p2d_busy_bound == 0.0
