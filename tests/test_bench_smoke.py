"""Smoke runs of `fluidpd bench serve` and `fluidpd bench switch` with --quick: each starts a
real (emulated) cluster, finishes, and prints one JSON object with the expected keys as its
last stdout line. The figures themselves are benchmarks, not asserted here — only that the
streams were exact and the switches lost nothing."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "bench", *args, "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    out = json.loads(last)
    assert isinstance(out, dict)
    return out


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def test_bench_serve_quick() -> None:
    out = _run("serve")
    assert out["bench"] == "serve"
    for name in (
        "ttft_overhead_ms",
        "per_token_overhead_ms",
        "bus_only_ttft_overhead_ms",
        "bus_only_per_token_overhead_ms",
        "engine_prefill_overshoot_ms",
        "engine_decode_overshoot_ms",
        "router_to_client_ms",
        "direct_ttft_ms",
        "direct_gap_ms",
        "router_ttft_ms",
        "router_minus_floor_ttft_ms",
    ):
        for q in ("p50", "p99"):
            assert _number(out[f"{name}_{q}"]), (name, q, out)
        assert out[f"{name}_p50"] <= out[f"{name}_p99"]
    assert out["goal_ttft_p99_ms"] == 2 and out["goal_per_token_ms"] == 0.5
    assert isinstance(out["meets_ttft_goal"], bool) and isinstance(
        out["meets_per_token_goal"], bool
    )
    # Every stream through the router, the bus and the stack floor delivered exactly the
    # reference tokens.
    assert out["mismatched_streams"] == 0
    assert out["floor_ttft_samples"] == out["requests"]
    for q in ("p50", "p99"):
        assert _number(out[f"floor_ttft_added_vs_direct_ms_{q}"])
    # The default layout on two or more CPUs: control plane on the first, workers on the rest.
    import os

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        assert out["control_cpus"] == cpus[:1] and out["worker_cpus"] == cpus[1:]
    else:
        assert out["control_cpus"] == [] and out["worker_cpus"] == []
    assert out["per_token_samples"] > 0 and out["bus_only_per_token_samples"] > 0
    # The baseline is the engine called directly, measured in the same run (and exact).
    assert out["direct_ttft_samples"] == out["requests"] and out["direct_per_token_samples"] > 0
    for name in ("ttft", "per_token", "bus_only_ttft", "bus_only_per_token"):
        for q in ("p50", "p99"):
            assert _number(out[f"{name}_added_vs_direct_ms_{q}"]), (name, q, out)
    assert out["direct_ttft_ms_p50"] >= out["engine_prefill_ms"]  # it does sleep the step


def test_bench_switch_quick() -> None:
    out = _run("switch")
    assert out["bench"] == "switch"
    emulated = out["results"]["emulated"]
    for setting in ("migrate", "no_migrate"):
        for kind in ("p2d", "d2p"):
            row = emulated[setting][kind]
            for key in ("drain_ms", "reslice_ms", "route_update_ms", "total_ms"):
                assert _number(row[key]) and row[key] >= 0, (setting, kind, key, row)
            assert row["errors"] == 0, row
        assert _number(emulated[setting]["p2d"]["overhead_beyond_prefill_ms"])
        # The running prefill was finished here, the queued ones handed to p0.
        assert emulated[setting]["p2d"]["handed_off"] >= 1
    assert emulated["migrate"]["d2p"]["migrated"] >= 1
    assert emulated["no_migrate"]["d2p"]["migrated"] == 0
    for key in ("meets_p2d_goal", "meets_d2p_goal"):
        assert isinstance(out[key], bool)
    assert out["goal_p2d_overhead_ms"] == 100 and out["goal_d2p_migrate_ms"] == 1000
