"""``fluidpd bench fluidtoken``: a prompt burst on an emulated 1P1D cluster, stealing on vs off.

Same arrivals twice: a background of decode traffic, then a burst of long prompts that drives
the prefill worker's PPI above 1. With FluidToken the decode worker absorbs prompt suffixes
within its TPOT-safe budget. Reports TTFT and TPOT attainment over the burst for both runs
(and over all requests), the stolen tokens and the peak PPI seen; last line JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

from services.bench.loadgen import PlannedRequest, run_open_loop, summarize
from services.common.cluster import Cluster
from services.common.cluster_spec import ClusterSpec
from shared.policy.config import PolicyConfig
from shared.policy.roles import DECODE


def burst_plan(
    burst: int,
    burst_prompt: int,
    background: int,
    *,
    burst_at_s: float = 1.0,
    burst_span_s: float = 0.5,
) -> list[PlannedRequest]:
    """Background decode traffic over the first seconds, then a burst of long prompts."""
    plan = [PlannedRequest(0.1 * i, 400, 120, "background") for i in range(background)]
    plan += [
        PlannedRequest(burst_at_s + burst_span_s * i / max(1, burst - 1), burst_prompt, 16, "burst")
        for i in range(burst)
    ]
    return sorted(plan, key=lambda p: p.arrival_s)


def run_config(
    fluidtoken: bool, plan: list[PlannedRequest], args: argparse.Namespace, log_dir: Path
) -> dict[str, Any]:
    worker_args = ("--max-num-seqs", "256") + (() if fluidtoken else ("--no-fluidtoken",))
    run_dir = log_dir / ("on" if fluidtoken else "off")
    run_dir.mkdir(parents=True, exist_ok=True)
    # The workers judge pressure against the SLOs on the compressed clock (their profile is
    # scaled by time_scale too); budgets may age a little longer than the 100 ms default
    # because 2 shared cores delay telemetry.
    policy = PolicyConfig(
        ttft_ms=args.slo_ttft_ms * args.time_scale,
        tpot_ms=args.slo_tpot_ms * args.time_scale,
        budget_stale_ms=500.0,
    )
    policy_path = run_dir / "policy.json"
    policy_path.write_text(json.dumps(policy.to_dict()))
    spec = ClusterSpec(
        prefill=1,
        decode=1,
        model="tiny",
        engine="emulated",
        port=0,
        profile=args.profile,
        time_scale=args.time_scale,
        worker_args=worker_args,
        auto_policy=False,
        policy_config=str(policy_path),
        log_dir=run_dir,
    )
    cluster = Cluster(spec)
    cluster.start()
    try:
        cluster.wait_ready(timeout_s=120)
        records = asyncio.run(
            run_open_loop(cluster.router_url, "tiny", plan, vocab_size=356, progress=False)
        )
        stolen = _stolen_tokens(cluster.operator_url)
    finally:
        cluster.stop()
    ttft_ms = args.slo_ttft_ms * args.time_scale
    tpot_ms = args.slo_tpot_ms * args.time_scale
    return {
        "fluidtoken": fluidtoken,
        "burst": summarize([r for r in records if r.label == "burst"], ttft_ms, tpot_ms),
        "background": summarize([r for r in records if r.label == "background"], ttft_ms, tpot_ms),
        "all": summarize(records, ttft_ms, tpot_ms),
        "stolen_tokens": stolen,
    }


def _stolen_tokens(nats_url: str) -> float:
    """Cumulative suffix tokens computed by decode workers, from `fluidpd ctl status`."""
    from shared.bus import Bus
    from shared.bus.config import BusConfig
    from shared.messages import StatusReply, StatusRequest, Subjects

    async def ask() -> float:
        subjects = Subjects()
        async with Bus(BusConfig.from_url(nats_url), subjects) as bus:
            reply = await bus.request(
                subjects.controller_status(), StatusRequest(), StatusReply, 5.0
            )
        return float(sum(row.stolen_tokens for row in reply.workers if row.role == DECODE))

    try:
        return asyncio.run(ask())
    except Exception:
        return -1.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fluidpd bench fluidtoken", description=__doc__)
    p.add_argument("--burst", type=int, default=24, help="long prompts in the burst")
    p.add_argument("--burst-prompt-tokens", type=int, default=3000)
    p.add_argument("--background", type=int, default=16)
    p.add_argument("--profile", default="", help="latency profile (default Llama-3.1-8B/A100)")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    args = p.parse_args(argv)
    plan = burst_plan(args.burst, args.burst_prompt_tokens, args.background)
    with tempfile.TemporaryDirectory(prefix="fluidpd-bench-ft-") as tmp:
        off = run_config(False, plan, args, Path(tmp))
        on = run_config(True, plan, args, Path(tmp))
    result = {
        "bench": "fluidtoken",
        "off": off,
        "on": on,
        "burst_ttft_attainment_gain_pp": round(
            100 * (on["burst"]["ttft_attainment"] - off["burst"]["ttft_attainment"]), 1
        ),
        "tpot_attainment_change_pp": round(
            100 * (on["all"]["tpot_attainment"] - off["all"]["tpot_attainment"]), 1
        ),
        "goal": "burst TTFT attainment rises; TPOT attainment at most 2 pp lower",
    }
    print(json.dumps(result))
    return 0
