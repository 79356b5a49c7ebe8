"""``fluidpd bench sim``: replay an Azure workload on the simulated cluster (services/sim).

For every configuration and RPS it writes ``DIR/<workload>_<config>_rps<R>.json`` (summary
with per-window attainment, switch log, time series for plots) and prints, as its LAST
stdout line, one JSON object::

    {"bench": "sim", "workload": ..., "workers": 8, "slo": {...}, "profile": ...,
     "results": {"<config>": {"<rps>": {"ttft_attainment": ..., "tpot_attainment": ...,
                 "joint_attainment": ..., "requests": n, "failed": n, "rejected": n,
                 "expired": n, "switches": n, "stolen_tokens": n,
                 "tpot_missed_after_ttft": n, "wall_s": s}}},
     "sim_wall_s": total seconds spent simulating}

Human-readable lines go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from services.bench.config_list import ALL, config_names
from services.bench.workloads import ARRIVALS, STAGED, WORKLOADS, window_of, workload_from_args
from services.cli.run_command import run_command
from services.sim.config import CONFIGS, ORACLE, ORACLE_LIVE, SimConfig
from services.sim.run import oracle_schedule, run_config
from shared.engine.profiles import DEFAULT_PROFILE, load_profile
from shared.policy.admission import SheddingConfig
from shared.policy.config import PAPER, RULE_SETS, PolicyConfig


def add_cluster_args(ap: argparse.ArgumentParser) -> None:
    """The simulated cluster's flags, shared by ``bench sim`` and ``bench sim-sweep``."""
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--max-prompt-tokens", type=int, default=None)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--prefill-workers", type=int, default=0, help="initial; 0 = half")
    ap.add_argument(
        "--policy-config",
        default="",
        help="PolicyConfig JSON file, as the controller's (a policy variant); --policy and "
        "the SLO flags, when given, override its fields",
    )
    ap.add_argument("--slo-ttft-ms", type=float, default=None, help="default: 2000")
    ap.add_argument("--slo-tpot-ms", type=float, default=None, help="default: 100")
    ap.add_argument("--profile", default=DEFAULT_PROFILE, help="shipped profile name or path")
    ap.add_argument("--max-num-seqs", type=int, default=SimConfig.max_num_seqs)
    ap.add_argument("--kv-gbps", type=float, default=25.0, help="KV link, GB/s")
    ap.add_argument(
        "--policy",
        choices=RULE_SETS,
        default=None,
        help="FluidRole rule set (default adaptive; paper: eq. 22-23 literally, one worker "
        "per decision, fixed cooldown, D->P drains by waiting)",
    )
    ap.add_argument(
        "--no-migrate",
        dest="migrate",
        action="store_false",
        help="D→P drain waits for running decodes (the paper) instead of live-migrating "
        "them (the real worker's default)",
    )
    ap.add_argument("--first-token-via-decode", action="store_true")
    ap.add_argument(
        "--queue-timeout-s",
        type=float,
        default=0.0,
        help="abort a request still queued for prefill after this long (SGLang: 60); 0 = never",
    )
    ap.add_argument(
        "--shed-ttft-multiple",
        type=float,
        default=SheddingConfig().ttft_multiple,
        help="router sheds a request whose predicted TTFT exceeds this multiple of the TTFT "
        "SLO (the live default); 0 = never",
    )
    ap.add_argument(
        "--expire-margin-s",
        type=float,
        default=SheddingConfig().expire_margin_s,
        help="prefill drops queued requests this long past their TTFT deadline (the live "
        "default); negative = never",
    )
    ap.add_argument(
        "--shed-decode-backlog",
        type=float,
        default=SheddingConfig().decode_backlog_batches,
        help="router sheds while every decode worker has this many batches (x max_num_seqs) "
        "of requests waiting for admission (the live default); 0 = never",
    )


def policy_config(args: argparse.Namespace) -> PolicyConfig:
    """``--policy-config`` (or the defaults) with ``--policy`` and the SLO flags that were
    given on top. Raises PolicyConfigError (a bad file or value) or OSError (no file)."""
    policy = PolicyConfig.load(args.policy_config) if args.policy_config else PolicyConfig()
    given = {
        "ttft_ms": args.slo_ttft_ms,
        "tpot_ms": args.slo_tpot_ms,
        "rules": args.policy,
    }
    overrides = {k: v for k, v in given.items() if v is not None}
    return PolicyConfig.from_dict({**policy.to_dict(), **overrides}) if overrides else policy


def base_config(args: argparse.Namespace) -> SimConfig:
    """The SimConfig the cluster flags describe. Raises SimConfigError/PolicyConfigError,
    OSError (a --policy-config file that cannot be read)."""
    policy = policy_config(args)
    margin = args.expire_margin_s
    return SimConfig(
        workers=args.workers,
        prefill_workers=args.prefill_workers,
        policy=policy,
        max_num_seqs=args.max_num_seqs,
        kv_bandwidth_bytes_per_s=args.kv_gbps * 1e9,
        # The paper drains a D→P worker by waiting for its decodes.
        migrate_on_drain=args.migrate and policy.rules != PAPER,
        first_token_via_decode=args.first_token_via_decode,
        queue_timeout_s=args.queue_timeout_s,
        shedding=SheddingConfig(
            ttft_multiple=args.shed_ttft_multiple,
            expire_margin_s=None if margin is None or margin < 0 else margin,
            decode_backlog_batches=args.shed_decode_backlog,
        ),
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="fluidpd bench sim", description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=WORKLOADS, default="azure-staged")
    ap.add_argument(
        "--config",
        default=ALL,
        help=f"{'|'.join([*CONFIGS, ORACLE])}|all, or a comma-separated list; also "
        f"{ORACLE_LIVE} (the oracle's splits in one continuous run; not part of all)",
    )
    ap.add_argument("--rps", default="10,20,30", help="comma-separated request rates")
    ap.add_argument("--requests", type=int, default=None, help="truncate the workload")
    ap.add_argument("--trace-offset", type=float, default=0.0, help="seconds into the traces")
    ap.add_argument(
        "--arrival",
        choices=ARRIVALS,
        default=None,
        help="arrival process (default: poisson for azure-staged, trace for azure-mixed)",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    add_cluster_args(ap)
    ap.add_argument("--out", default="", help="directory for per-run JSON files")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    profile = load_profile(args.profile)
    base = base_config(args)  # bad input: run_command's one line, exit 2
    policy = base.policy
    out_dir = Path(args.out) if args.out else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    rates = [float(r) for r in args.rps.split(",") if r.strip()]
    results: dict[str, dict[str, Any]] = {}
    total_wall = 0.0
    for rps in rates:
        trace = workload_from_args(
            args, rps, time_scale=args.time_scale, max_prompt_tokens=args.max_prompt_tokens
        )
        starts: dict[str, float] = {}  # first arrival of each stage (plots mark them)
        if args.workload == STAGED:
            for t in trace:
                starts.setdefault(window_of(t), t.arrival_s)
        schedule = None  # this trace's oracle splits, once run (oracle-live follows them)
        for name in config_names(args.config, (*CONFIGS, ORACLE), (ORACLE_LIVE,)):
            t0 = time.perf_counter()
            # azure-mixed has one window: its oracle is the best single static split.
            res = run_config(trace, name, base, profile, schedule=schedule)
            if name == ORACLE:
                schedule = oracle_schedule(res)
            wall = time.perf_counter() - t0
            total_wall += wall
            s = res.summary(policy.ttft_s, policy.tpot_s)
            row = {
                "ttft_attainment": round(s["ttft_attainment"], 4),
                "tpot_attainment": round(s["tpot_attainment"], 4),
                "joint_attainment": round(s["joint_attainment"], 4),
                "requests": s["requests"],
                "failed": s["failed"],
                "rejected": s["rejected"],
                "expired": s["expired"],
                "switches": s["switches"],
                "stolen_tokens": s["stolen_tokens"],
                "tpot_missed_after_ttft": s["tpot_missed_after_ttft"],
                "per_window_joint": {
                    w: round(v["joint_attainment"], 4) for w, v in s["per_window"].items()
                },
                "wall_s": round(wall, 2),
            }
            if "notes" in s:  # oracle_splits, or oracle-live's schedule_prefill_workers
                row.update(s["notes"])
            results.setdefault(name, {})[f"{rps:g}"] = row
            print(
                f"{args.workload} rps={rps:g} {name:6s} joint={row['joint_attainment']:.3f} "
                f"ttft={row['ttft_attainment']:.3f} tpot={row['tpot_attainment']:.3f} "
                f"switches={row['switches']} stolen={row['stolen_tokens']} "
                f"n={row['requests']} wall={wall:.1f}s",
                file=sys.stderr,
            )
            if out_dir is not None:
                doc = res.to_json_dict(policy.ttft_s, policy.tpot_s)
                doc.update(workload=args.workload, rps=rps, config=name, stage_starts_s=starts)
                path = out_dir / f"{args.workload}_{name}_rps{rps:g}.json"
                path.write_text(json.dumps(doc, allow_nan=False) + "\n", encoding="utf-8")
    summary = {
        "bench": "sim",
        "workload": args.workload,
        "workers": args.workers,
        "slo": {"ttft_ms": policy.ttft_ms, "tpot_ms": policy.tpot_ms},
        "profile": f"{profile.model} on {profile.hardware}",
        "max_num_seqs": args.max_num_seqs,
        "policy": policy.rules,
        "policy_config": args.policy_config or None,
        "shedding": {
            "ttft_multiple": base.shedding.ttft_multiple,
            "expire_margin_s": base.shedding.expire_margin_s,
        },
        "results": results,
        "sim_wall_s": round(total_wall, 2),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(run_command("fluidpd bench sim", main, sys.argv[1:]))
