"""FluidToken under a prompt burst (emulated engine, 1P1D, real processes): same arrivals with
stealing off and on; stealing happens, the burst's TTFT improves, TPOT attainment holds."""

from __future__ import annotations

import argparse
from pathlib import Path

from services.bench.fluidtoken import burst_plan, run_config


def test_burst_stealing_improves_ttft(tmp_path: Path) -> None:
    args = argparse.Namespace(profile="", time_scale=0.4, slo_ttft_ms=2000.0, slo_tpot_ms=100.0)
    plan = burst_plan(burst=16, burst_prompt=3000, background=8)
    off = run_config(False, plan, args, tmp_path)
    on = run_config(True, plan, args, tmp_path)
    print(
        f"burst TTFT attainment off={off['burst']['ttft_attainment']} "
        f"on={on['burst']['ttft_attainment']}; TPOT attainment off="
        f"{off['all']['tpot_attainment']} on={on['all']['tpot_attainment']}; "
        f"stolen={on['stolen_tokens']}"
    )
    assert off["all"]["errors"] == 0 and on["all"]["errors"] == 0
    assert off["stolen_tokens"] == 0 and on["stolen_tokens"] > 0
    assert on["burst"]["ttft_p95_ms"] < off["burst"]["ttft_p95_ms"]
    assert on["burst"]["ttft_attainment"] >= off["burst"]["ttft_attainment"]
    assert on["all"]["tpot_attainment"] >= off["all"]["tpot_attainment"] - 0.02
