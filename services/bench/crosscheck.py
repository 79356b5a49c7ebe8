"""Simulator vs emulated cluster on the same workload slice (``python -m
services.bench.crosscheck``).

For each operating point ``CONFIG:RPS`` it replays the same requests (``--workload``,
``--requests``, ``--trace-offset``) through the discrete-event simulator (services/sim, the
same policy code and latency profile) and through a fresh emulated cluster
(``bench replay``'s ``run_once``, time-compressed by ``--time-scale``), and reports both
attainments and whether they agree within ``--tolerance-pp`` (default 5 pp) on joint, TTFT
and TPOT attainment. The simulator runs with ``migrate_on_drain`` (the workers' default) and
the cluster's ``max_num_seqs``.

Last stdout line: ``{"bench": "crosscheck", "points": [{"config", "rps", "sim": {...},
"emulated": {...}, "diff_pp": {...}, "agree": bool}], ...}``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from services.bench.replay import plan_of, scaled_policy, scaled_profile
from services.bench.replay_run import FLUIDTOKEN, RunSpec, run_once
from services.bench.workloads import ARRIVALS, STAGED, WORKLOADS, workload_from_args
from services.cli.run_command import run_command
from services.sim.config import SimConfig
from services.sim.run import run_config
from shared.engine.profiles import load_profile
from shared.policy.config import PolicyConfig

KEYS = ("joint_attainment", "ttft_attainment", "tpot_attainment")


def parse_points(text: str) -> list[tuple[str, float]]:
    """``CONFIG:RPS,...`` → pairs; raises ValueError on any bad item (before anything runs)."""
    out = []
    for item in text.split(","):
        cfg, _, rps_text = item.strip().partition(":")
        try:
            rps = float(rps_text)
        except ValueError:
            rps = 0.0  # refused below, with the item named
        if cfg not in FLUIDTOKEN or not (math.isfinite(rps) and rps > 0):
            raise ValueError(
                f"bad point {item!r}: want CONFIG:RPS with RPS > 0, e.g. static:10; "
                f"configs: {', '.join(FLUIDTOKEN)}"
            )
        out.append((cfg, rps))
    return out


def sim_point(
    cfg: str, rps: float, args: argparse.Namespace, policy: PolicyConfig
) -> dict[str, Any]:
    trace = workload_from_args(args, rps)
    base = SimConfig(
        workers=args.workers, policy=policy, max_num_seqs=args.max_num_seqs, migrate_on_drain=True
    )
    res = run_config(trace, cfg, base, load_profile(args.profile))
    s = res.summary(policy.ttft_s, policy.tpot_s)
    out = {k: round(float(s[k]), 4) for k in KEYS}
    out.update(requests=s["requests"], failed=s["failed"], switches=s["switches"])
    out["stolen_tokens"] = s["stolen_tokens"]
    return out


def emulated_point(cfg: str, rps: float, args: argparse.Namespace, base: RunSpec) -> dict[str, Any]:
    plan = plan_of(args, rps)
    row = run_once(replace(base, config=cfg, rps=rps, tag=f"xcheck-{cfg}"), plan)
    keep = (*KEYS, "requests", "errors", "switches", "stolen_tokens", "per_window")
    out = {k: row[k] for k in keep}
    out["loadgen_bottleneck_verdict"] = row["loadgen_bottleneck"]["verdict"]
    out["machine_cpu_busy_fraction"] = row["loadgen_bottleneck"]["machine_cpu_busy_fraction"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m services.bench.crosscheck", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--workload", choices=WORKLOADS, default=STAGED)
    ap.add_argument("--points", default="static:10,full:10", help="CONFIG:RPS,...")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--trace-offset", type=float, default=0.0)
    ap.add_argument("--arrival", choices=ARRIVALS, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-scale", type=float, default=0.5)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--profile", default="")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0)
    ap.add_argument("--tolerance-pp", type=float, default=5.0)
    ap.add_argument("--out", default="")
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    point_list = parse_points(args.points)
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fluidpd-xcheck-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    s = args.time_scale
    profile_path = out_dir / "profile.json"
    profile_path.write_text(scaled_profile(load_profile(args.profile), s).to_json() + "\n")
    policy_path = out_dir / "policy.json"
    policy_path.write_text(scaled_policy(args.slo_ttft_ms, args.slo_tpot_ms, s).to_json() + "\n")
    base = RunSpec(
        config="static",
        workers=args.workers,
        prefill=args.workers // 2,
        profile_path=str(profile_path),
        policy_path=str(policy_path),
        time_scale=s,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        out_dir=out_dir,
        max_num_seqs=args.max_num_seqs,
    )
    policy = PolicyConfig(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    points = []
    for cfg, rps in point_list:
        sim = sim_point(cfg, rps, args, policy)
        emu = emulated_point(cfg, rps, args, base)
        diff = {k: round(100 * (emu[k] - sim[k]), 1) for k in KEYS}
        agree = all(abs(v) <= args.tolerance_pp for v in diff.values())
        points.append(
            {
                "config": cfg,
                "rps": rps,
                "sim": sim,
                "emulated": emu,
                "diff_pp": diff,
                "agree": agree,
            }
        )
        print(
            f"{cfg} rps={rps:g}: sim joint={sim['joint_attainment']:.3f} "
            f"emulated joint={emu['joint_attainment']:.3f} diff={diff['joint_attainment']:+.1f} pp "
            f"{'agree' if agree else 'DISAGREE'}",
            file=sys.stderr,
        )
    print(
        json.dumps(
            {
                "bench": "crosscheck",
                "workload": args.workload,
                "requests": args.requests,
                "workers": args.workers,
                "time_scale": s,
                "tolerance_pp": args.tolerance_pp,
                "out": str(out_dir),
                "points": points,
                "all_agree": all(p["agree"] for p in points),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_command("python -m services.bench.crosscheck", main, sys.argv[1:]))
