"""``fluidpd bench replay``: open-loop replay of an Azure workload against the router's HTTP
API (streaming), per configuration and request rate, on a fresh local cluster each run.

Configurations (FluidPD paper §V): ``static`` = 4P4D, round-robin pairing, no FluidToken,
no FluidRole; ``token`` = FluidToken only (pressure pairing); ``role`` = FluidRole only;
``full`` = both; ``static-pressure`` = static with pressure pairing; ``static-paper`` = the
paper's own baseline (static, no door, queued work dropped 60 s trace time after arrival;
the ``--shed-*`` / ``--expire-margin-s`` flags do not apply to it); ``oracle`` = every window
of the workload run on its own under each static split (``--oracle-splits``, default all
1P7D..7P1D) keeping the best per window.

Time compression (``--time-scale s``): arrivals × s, SLOs × s, and every time coefficient of
the latency profile × s — the workers get a uniformly scaled copy of the profile (what the
emulated engine's own ``--time-scale`` does to its sleeps) so that their predictors agree
with the engine from the first request instead of after online recalibration converges. The
policy's time constants (TTFT/TPOT SLOs, ε, PPI window, decision interval, cooldown) are
scaled by s in a policy-config file handed to controller and workers; the telemetry period
and budget staleness stay real-time (they are transport cadences, not workload time).

Per run it writes ``--out DIR/requests-<config>-<rps>.jsonl`` (one record per request) and
``DIR/run-<config>-<rps>.json`` (summary, time series in trace seconds, switch log), and
prints one JSON object as the LAST stdout line (``results[config][rps]`` with
``ttft_attainment``, ``tpot_attainment``, ``joint_attainment``, counts, ``errors`` — of
which ``rejected`` (503 before any 200: shed or dropped past the deadline; not attained) and
``failed_after_accept`` (an error after a 200), each with its fraction —,
``tpot_missed_after_ttft`` (met the TTFT SLO, missed TPOT) and a ``loadgen_bottleneck``
section; ``comparisons[rps]`` holds ``full_minus_<baseline>_pp`` for
each static baseline that ran beside ``full``). With ``--url`` it replays against an existing router once
(label ``external``) and starts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from services.bench.config_list import config_names
from services.bench.loadgen import PlannedRequest
from services.bench.replay_run import RunSpec, run_once
from services.bench.workloads import ARRIVALS, STAGED, WORKLOADS, window_of, workload_from_args
from shared.engine.profiles import load_profile
from shared.policy.admission import (
    DEFAULT_DECODE_BACKLOG_BATCHES,
    DEFAULT_EXPIRE_MARGIN_S,
    DEFAULT_TTFT_MULTIPLE,
    SheddingConfig,
)
from shared.policy.config import ADAPTIVE, PAPER, RULE_SETS, PolicyConfig
from shared.policy.errors import PolicyConfigError
from shared.policy.predictors import LatencyProfile

CONFIGS = ("static", "static-pressure", "static-paper", "token", "role", "full", "oracle")
BASELINES = ("static", "static-pressure", "static-paper", "oracle")


def scaled_profile(profile: LatencyProfile, time_scale: float) -> LatencyProfile:
    """Every time coefficient × ``time_scale`` (sizes unchanged)."""
    return profile.scaled(
        time_scale, note=f"\n[fluidpd bench replay: every time coefficient x {time_scale:g}]"
    )


def scaled_policy(
    ttft_ms: float, tpot_ms: float, time_scale: float, rules: str = ADAPTIVE
) -> PolicyConfig:
    """PolicyConfig with the SLOs and the controller's time constants × ``time_scale``.
    Raises PolicyConfigError for an unknown rule set."""
    base = PolicyConfig(ttft_ms=ttft_ms, tpot_ms=tpot_ms, rules=rules)
    return replace(
        base,
        ttft_ms=ttft_ms * time_scale,
        tpot_ms=tpot_ms * time_scale,
        ppi_epsilon_ms=base.ppi_epsilon_ms * time_scale,
        window_s=base.window_s * time_scale,
        decision_interval_s=base.decision_interval_s * time_scale,
        cooldown_s=base.cooldown_s * time_scale,
        settle_s=base.settle_s * time_scale,
        reverse_wait_s=base.reverse_wait_s * time_scale,
        reverse_wait_binds_s=base.reverse_wait_binds_s * time_scale,
        decode_flow_window_s=base.decode_flow_window_s * time_scale,
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="fluidpd bench replay", description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=WORKLOADS, default=STAGED)
    ap.add_argument("--config", default="static,full", help=f"{'|'.join(CONFIGS)}|all, comma list")
    ap.add_argument("--rps", default="10", help="comma-separated request rates (trace time)")
    ap.add_argument("--requests", type=int, default=None, help="truncate the workload")
    ap.add_argument("--trace-offset", type=float, default=0.0, help="seconds into the traces")
    ap.add_argument(
        "--arrival", choices=ARRIVALS, default=None, help="default: poisson staged, trace mixed"
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    ap.add_argument("--time-scale", type=float, default=1.0, help="< 1 compresses time")
    ap.add_argument("--engine", choices=("emulated", "torch"), default="emulated")
    ap.add_argument("--model", default="tiny", help="model the workers load")
    ap.add_argument("--profile", default="", help="latency profile (default Llama-3.1-8B/A100)")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument(
        "--shed-ttft-multiple",
        type=float,
        default=DEFAULT_TTFT_MULTIPLE,
        help="routers shed above this multiple of the TTFT SLO (0: off)",
    )
    ap.add_argument(
        "--shed-decode-backlog",
        type=float,
        default=DEFAULT_DECODE_BACKLOG_BATCHES,
        help="routers shed when every decode worker has this many batches waiting (0: off)",
    )
    ap.add_argument(
        "--expire-margin-s",
        type=float,
        default=DEFAULT_EXPIRE_MARGIN_S,
        help="prefill workers drop queued work this long past its deadline (trace s; <0: off)",
    )
    ap.add_argument(
        "--policy",
        choices=RULE_SETS,
        default=ADAPTIVE,
        help="FluidRole rule set of the controller (paper: eq. 22-23 literally, drain by waiting)",
    )
    ap.add_argument("--oracle-splits", default="", help="prefill counts to try, e.g. 3,4,5")
    ap.add_argument("--url", default="", help="replay against this router; start nothing")
    ap.add_argument("--out", default="", help="directory for records and run files")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per request (real s)")
    a = ap.parse_args(argv)
    if a.workers < 2:
        ap.error("--workers must be >= 2")
    if not a.time_scale > 0:
        ap.error("--time-scale must be > 0")
    try:  # the routers' own rules (RouterConfig.shedding), checked before anything starts
        SheddingConfig(
            ttft_multiple=a.shed_ttft_multiple,
            expire_margin_s=None,
            decode_backlog_batches=a.shed_decode_backlog,
        )
    except PolicyConfigError as exc:
        ap.error(f"--shed-ttft-multiple / --shed-decode-backlog: {exc}")
    if a.engine == "torch" and a.time_scale != 1.0:
        ap.error("--time-scale applies to the emulated engine only (torch computes for real)")
    return a


def plan_of(args: argparse.Namespace, rps: float) -> list[PlannedRequest]:
    trace = workload_from_args(args, rps, time_scale=args.time_scale)
    return [
        PlannedRequest(t.arrival_s, t.prompt_tokens, t.output_tokens, window_of(t)) for t in trace
    ]


def _oracle(
    args: argparse.Namespace, base: RunSpec, plan: list[PlannedRequest], rps: float
) -> dict[str, Any]:
    """Every window under every candidate split on a fresh cluster; best per window."""
    splits = [int(x) for x in args.oracle_splits.split(",") if x.strip()] or list(
        range(1, args.workers)
    )
    windows = sorted({p.label for p in plan}, key=lambda s: int(s.split(":")[0]))
    chosen: dict[str, Any] = {}
    kept: list[dict[str, Any]] = []
    for w in windows:
        reqs = [p for p in plan if p.label == w]
        t0 = reqs[0].arrival_s
        reqs = [replace(p, arrival_s=p.arrival_s - t0) for p in reqs]
        best: tuple[tuple[float, float], dict[str, Any], int] | None = None
        for n_p in splits:
            spec = replace(base, config="static", prefill=n_p, tag=f"oracle-w{w[0]}-{n_p}P")
            res = run_once(spec, reqs)
            key = (res["joint_attainment"], -abs(n_p - args.workers / 2))
            if best is None or key > best[0]:
                best = (key, res, n_p)
        assert best is not None
        chosen[w] = {"prefill_workers": best[2], "joint_attainment": best[1]["joint_attainment"]}
        kept.append(best[1])
    return _stitch(kept, chosen, splits, len(plan))


def _stitch(
    parts: list[dict[str, Any]], chosen: dict[str, Any], splits: list[int], n: int
) -> dict[str, Any]:
    def frac(key: str) -> float:
        return round(sum(p[key] * p["requests"] for p in parts) / n, 4) if n else 0.0

    return {
        "ttft_attainment": frac("ttft_attainment"),
        "tpot_attainment": frac("tpot_attainment"),
        "joint_attainment": frac("joint_attainment"),
        "requests": sum(p["requests"] for p in parts),
        "completed": sum(p["completed"] for p in parts),
        "errors": sum(p["errors"] for p in parts),
        "tpot_missed_after_ttft": sum(p.get("tpot_missed_after_ttft", 0) for p in parts),
        "rejected": sum(p.get("rejected", 0) for p in parts),
        "rejected_fraction": frac("rejected_fraction"),
        "failed_after_accept": sum(p.get("failed_after_accept", 0) for p in parts),
        "failed_after_accept_fraction": frac("failed_after_accept_fraction"),
        "oracle_splits": chosen,
        "oracle_candidates": splits,
        "per_window": {w: c["joint_attainment"] for w, c in chosen.items()},
        "loadgen_bottleneck": [p["loadgen_bottleneck"] for p in parts],
    }


def comparisons(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per rps, ``full`` − each baseline that ran at that rps, in pp of joint attainment."""
    out: dict[str, dict[str, float]] = {}
    for rps, row in results.get("full", {}).items():
        for name in BASELINES:
            other = results.get(name, {}).get(rps)
            if other is not None:
                key = f"full_minus_{name.replace('-', '_')}_pp"
                gap_pp = 100.0 * (row["joint_attainment"] - other["joint_attainment"])
                out.setdefault(rps, {})[key] = round(gap_pp, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fluidpd-replay-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    s = args.time_scale
    profile_path, policy_path = "", ""
    if args.engine == "emulated":
        prof = load_profile(args.profile)
        if s != 1.0:
            prof = scaled_profile(prof, s)
        profile_path = str(out_dir / "profile.json")
        Path(profile_path).write_text(prof.to_json() + "\n", encoding="utf-8")
    policy = scaled_policy(args.slo_ttft_ms, args.slo_tpot_ms, s, args.policy)
    policy_path = str(out_dir / "policy.json")
    Path(policy_path).write_text(policy.to_json() + "\n", encoding="utf-8")
    base = RunSpec(
        config="static",
        workers=args.workers,
        prefill=args.workers // 2,
        engine=args.engine,
        model=args.model,
        profile_path=profile_path,
        policy_path=policy_path,
        time_scale=s,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        out_dir=out_dir,
        url=args.url,
        timeout_s=args.timeout_s,
        shed_ttft_multiple=args.shed_ttft_multiple,
        shed_decode_backlog=args.shed_decode_backlog,
        expire_margin_s=args.expire_margin_s,
        paper_rules=args.policy == PAPER,
    )
    names = ["external"] if args.url else config_names(args.config, CONFIGS)
    results: dict[str, dict[str, Any]] = {}
    for rps in [float(r) for r in args.rps.split(",") if r.strip()]:
        plan = plan_of(args, rps)
        for name in names:
            if name == "oracle":
                row = _oracle(args, replace(base, rps=rps), plan, rps)
            else:
                row = run_once(replace(base, config=name, rps=rps, tag=name), plan)
            results.setdefault(name, {})[f"{rps:g}"] = row
            print(
                f"{args.workload} rps={rps:g} {name:8s} joint={row['joint_attainment']:.3f} "
                f"ttft={row['ttft_attainment']:.3f} tpot={row['tpot_attainment']:.3f} "
                f"n={row['requests']} errors={row['errors']} "
                f"rejected={row.get('rejected', 0)} "
                f"failed_after_accept={row.get('failed_after_accept', 0)}",
                file=sys.stderr,
            )
    summary = {
        "bench": "replay",
        "workload": args.workload,
        "engine": args.engine,
        "workers": args.workers,
        "time_scale": s,
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms, "scaled_by": s},
        "requests": args.requests,
        "trace_offset_s": args.trace_offset,
        "shed_ttft_multiple": args.shed_ttft_multiple,
        "shed_decode_backlog": args.shed_decode_backlog,
        "expire_margin_s": args.expire_margin_s,
        "out": str(out_dir),
        "policy_config": policy.to_dict(),
        "results": results,
        "comparisons": comparisons(results),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
