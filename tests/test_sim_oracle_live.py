"""The ``oracle-live`` yardstick (services/sim/oracle_live.py): the oracle's per-window
splits applied to one continuous run at each window's first arrival, through the real switch
mechanics; and how bench sim / sim-sweep name and summarize it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.bench import sim_sweep
from services.bench.config_list import config_names
from services.bench.workloads import build_workload
from services.sim import SimConfig, config_for, run_config, run_oracle
from services.sim.config import ORACLE_LIVE
from services.sim.oracle_live import SCRIPT_TICK_S, ScheduledRoles, run_oracle_live
from shared.engine.profiles import load_profile
from shared.trace_request import TraceRequest

PROFILE = load_profile()


def two_windows() -> list[TraceRequest]:
    """Window 0: a decode-heavy mix for 20 s; window 1 from t = 20 s: long prompts."""
    first = [TraceRequest(i / 4.0, 800, 200, "conv", 0) for i in range(80)]
    second = [TraceRequest(20.0 + i / 4.0, 6000, 8, "code", 1) for i in range(80)]
    return first + second


def test_the_schedule_moves_workers_at_the_first_arrival_of_each_window() -> None:
    trace = two_windows()
    res = run_oracle_live(trace, SimConfig(workers=4), PROFILE, {0: 1, 1: 3})
    done = [s for s in res.switches if not s.get("cancelled")]
    # 1P3D from the start (no switch in window 0), then two D->P moves, both started at the
    # first arrival of window 1 (within a tick), and nothing else.
    assert [s["to"] for s in done] == ["prefill", "prefill"]
    overhead_s = SimConfig().switch_overhead_s
    for s in done:
        started_s = s["t_s"] - s["drain_s"] - overhead_s  # the log rounds to 1 ms
        assert 20.0 - 1e-3 <= started_s <= 20.0 + SCRIPT_TICK_S + 1e-3, s
    assert res.notes == {"schedule_prefill_workers": {"0": 1, "1": 3}}
    assert res.count == len(trace)


def test_moves_back_when_the_schedule_asks_for_fewer_prefill_workers() -> None:
    trace = two_windows()
    # Starts at 3P1D; the first control tick (1 s in) finds 3 prefill workers and wants 1.
    cfg = config_for("full", SimConfig(workers=4, prefill_workers=3))
    sim = ScheduledRoles(trace, cfg, PROFILE, {0: 1, 1: 1})
    res = sim.run()
    moves = [s for s in res.switches if not s.get("cancelled")]
    assert [s["to"] for s in moves] == ["decode", "decode"]
    assert moves[-1]["t_s"] < 2.0  # the first decision tick, 1 s in, plus the drain
    assert sum(1 for w in sim.workers if w.role == "prefill") == 1


def test_a_schedule_needs_control_ticks() -> None:
    with pytest.raises(ValueError, match="fluidrole"):
        ScheduledRoles(two_windows(), SimConfig(workers=4), PROFILE, {0: 2})


def test_run_config_follows_the_oracles_own_splits() -> None:
    trace = build_workload("azure-staged", rps=30, requests=600)
    oracle = run_oracle(trace, SimConfig(), PROFILE).notes["oracle_splits"]
    live = run_config(trace, ORACLE_LIVE, SimConfig(), PROFILE)
    want = {w: v["prefill_workers"] for w, v in oracle.items()}
    assert live.notes["schedule_prefill_workers"] == want
    assert live.label == ORACLE_LIVE and live.count == len(trace)


def test_oracle_live_is_named_on_request_only() -> None:
    known, extra = ("static", "full", "oracle"), (ORACLE_LIVE,)
    assert config_names("all", known, extra) == ["static", "full", "oracle"]
    assert config_names("full,oracle-live", known, extra) == ["full", ORACLE_LIVE]
    with pytest.raises(ValueError, match="oracle-live"):  # the error lists it as known
        config_names("bogus", known, extra)


# One sweep cell small enough for a test: staged 30 rps, 300 requests, seed 0, offset 0.
SWEEP_CELL = ["--workloads", "azure-staged", "--seeds", "0", "--offsets", "0"]
SWEEP_CELL += ["--rps-staged", "30", "--requests-staged", "300"]


def sweep_row(out: Path, *extra: str) -> dict[str, Any]:
    """Run ``fluidpd bench sim-sweep`` on SWEEP_CELL (plus ``extra``) into ``out``; its row."""
    assert sim_sweep.main([*SWEEP_CELL, *extra, "--out", str(out)]) == 0
    (row,) = sim_sweep.load_rows(str(out))
    return row


def test_the_sweep_adds_oracle_live_to_reused_rows_and_summarizes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    row_a = sweep_row(first)
    assert ORACLE_LIVE not in row_a  # not part of a default sweep
    chosen = row_a["oracle"][sim_sweep.SPLITS]
    assert sorted(chosen) == ["0", "1", "2"] and chosen["0"] != 1  # one split per stage
    # The reused row's splits, not a re-run oracle, drive the schedule: a split the oracle
    # never picks (a single prefill worker for the first stage) must be followed.
    row_a["oracle"][sim_sweep.SPLITS] = {**chosen, "0": 1}
    first.write_text(json.dumps(row_a) + "\n")
    capsys.readouterr()
    row_b = sweep_row(second, "--configs", ORACLE_LIVE, "--reuse", str(first))
    for name in sim_sweep.CONFIGS:
        assert row_b[name] == row_a[name]  # copied
    assert row_b[ORACLE_LIVE][sim_sweep.SPLITS] == {**chosen, "0": 1}
    live = row_b[ORACLE_LIVE]["joint"]
    assert 0.0 <= live <= 1.0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cell = summary["by_rps"]["azure-staged"]["30"]["all"]
    gap = round(100.0 * (live - row_b["oracle"]["joint"]), 1)
    assert cell["oracle_live_minus_oracle_pp"] == {"min": gap, "median": gap}
    assert cell["oracle_live_goal_cells_failed"] == int(
        not sim_sweep.cell_goal_ok(row_b, ORACLE_LIVE)
    )


def test_the_sweep_runs_the_oracle_again_for_rows_without_stored_splits(
    tmp_path: Path,
) -> None:
    # Rows written before the oracle's row stored its splits (sim20-* and older).
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    row_a = sweep_row(first)
    chosen = row_a["oracle"].pop(sim_sweep.SPLITS)
    first.write_text(json.dumps(row_a) + "\n")
    row_b = sweep_row(second, "--configs", ORACLE_LIVE, "--reuse", str(first))
    assert row_b[ORACLE_LIVE][sim_sweep.SPLITS] == chosen  # the re-run oracle's own splits
