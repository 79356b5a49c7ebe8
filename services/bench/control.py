"""Control-overhead benchmark: PPI (eq. 5) + Algorithm 1 per prefill scheduling iteration.

``fluidpd bench control`` (or ``python -m services.bench.control``). For each queue size it
builds random but realistic prefill queues — log-normal prompt lengths (median ~1.5k tokens,
clipped to [16, 16k]), arrivals spread over the last TTFT budget so part of the queue is at
risk, several paired decode workers with fresh budgets (some exhausted, one stale) — and
times one ``select_steal_ratios`` call (which computes PPI in the same pass) per iteration,
plus ``queue_ppi`` alone. Prints a human table to stderr and, as its LAST stdout line, one
JSON object: {"bench": "control", "results": [{"queue": n, "median_us": …, "p99_us": …}, …],
"goal_us_at_256": 50, "meets_goal": bool}.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Sequence

from shared.policy.config import PolicyConfig
from shared.policy.fluidtoken import StealBudget, select_steal_ratios
from shared.policy.predictors import LatencyProfile, example_profile
from shared.policy.prefill_pressure import QueuedRequest, queue_ppi

GOAL_US_AT_256 = 50.0


def make_queue(
    rng: random.Random, n: int, now_s: float, cfg: PolicyConfig, decode_ids: Sequence[str]
) -> list[QueuedRequest]:
    """n queued requests in FCFS order, arrivals within the last ~TTFT, random pairing."""
    arrivals = sorted(now_s - rng.uniform(0.0, cfg.ttft_s * 0.9) for _ in range(n))
    out = []
    for i, arr in enumerate(arrivals):
        tokens = int(min(16384, max(16, rng.lognormvariate(math.log(1500), 0.9))))
        out.append(QueuedRequest(f"r{i}", arr, tokens, rng.choice(decode_ids)))
    return out


def make_budgets(
    rng: random.Random, now_s: float, decode_ids: Sequence[str]
) -> dict[str, StealBudget]:
    budgets = {}
    for k, d in enumerate(decode_ids):
        tokens = 0.0 if k % 4 == 3 else rng.uniform(200.0, 4000.0)
        published = now_s - (1.0 if k % 5 == 4 else rng.uniform(0.0, 0.05))  # one stale
        budgets[d] = StealBudget(tokens, published)
    return budgets


def _percentile(sorted_vals: Sequence[float], q: float) -> float:
    return sorted_vals[min(len(sorted_vals) - 1, max(0, math.ceil(q * len(sorted_vals)) - 1))]


def bench_size(
    n: int, iterations: int, profile: LatencyProfile, cfg: PolicyConfig, seed: int
) -> dict[str, float | int]:
    rng = random.Random(seed)
    decode_ids = [f"d{k}" for k in range(6)]
    scenarios = []
    for _ in range(16):  # distinct queues, cycled, so caches do not flatter one input
        now_s = 1000.0 + rng.uniform(0.0, 100.0)
        scenarios.append(
            (
                make_queue(rng, n, now_s, cfg, decode_ids),
                make_budgets(rng, now_s, decode_ids),
                now_s,
            )
        )
    times_ns: list[int] = []
    ppi_ns: list[int] = []
    stolen = at_risk = 0
    perf = time.perf_counter_ns
    for it in range(iterations):
        queue, budgets, now_s = scenarios[it % len(scenarios)]
        t0 = perf()
        plan = select_steal_ratios(queue, budgets, profile, cfg, now_s)
        t1 = perf()
        queue_ppi(queue, profile, cfg, now_s)
        t2 = perf()
        times_ns.append(t1 - t0)
        ppi_ns.append(t2 - t1)
        stolen += len(plan.stolen_tokens)
        at_risk += plan.at_risk
    times_ns.sort()
    ppi_ns.sort()
    return {
        "queue": n,
        "iterations": iterations,
        "median_us": round(_percentile(times_ns, 0.5) / 1000.0, 2),
        "p99_us": round(_percentile(times_ns, 0.99) / 1000.0, 2),
        "ppi_only_median_us": round(_percentile(ppi_ns, 0.5) / 1000.0, 2),
        "mean_split_requests": round(stolen / iterations, 2),
        "mean_at_risk": round(at_risk / iterations, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fluidpd bench control", description=__doc__)
    parser.add_argument("--sizes", default="16,256,4096", help="comma-separated queue lengths")
    parser.add_argument("--iterations", type=int, default=0, help="0: auto per size")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    profile = example_profile()
    cfg = PolicyConfig()
    results = []
    for n in sizes:
        iters = args.iterations or max(200, min(5000, 400_000 // max(n, 1)))
        bench_size(n, max(20, iters // 10), profile, cfg, args.seed)  # warm-up
        res = bench_size(n, iters, profile, cfg, args.seed)
        results.append(res)
        print(
            f"queue={n:5d}  PPI+Alg1 median {res['median_us']:8.2f} us  p99 {res['p99_us']:8.2f} us"
            f"  (PPI alone {res['ppi_only_median_us']:.2f} us, splits {res['mean_split_requests']})",
            file=sys.stderr,
        )
    at_256 = next((r for r in results if r["queue"] == 256), None)
    summary = {
        "bench": "control",
        "python": sys.version.split()[0],
        "results": results,
        "goal_us_at_256": GOAL_US_AT_256,
        "meets_goal": None if at_256 is None else at_256["median_us"] < GOAL_US_AT_256,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
