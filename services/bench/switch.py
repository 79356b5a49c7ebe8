"""``fluidpd bench switch`` (issue 6): FluidRole switch durations, P→D and D→P, split into
drain, re-slice and route update, with and without live migration.

Cluster per engine (no router, no controller — the bench is the only one that switches):
prefill worker p0, decode worker d0 (the fixed pair), and the two workers that switch: d1
(default: live migration on) and d2 (started with ``--no-migrate``). FluidToken is off so
that every first token comes from a prefill worker and the running prefill is known.

* D→P under load: K requests with long outputs (paper scale: 1000–2000 tokens, so that
  waiting for them would take many seconds) go p0 → w; once every one has streamed a few
  tokens the bench sends ``SwitchCommand(prefill)`` to w over the bus. With migration the
  drain moves them to d0/d2; without, it waits until they finish.
* P→D under load: w (now prefill) gets K long prompts paired with d0; right after the
  first one's first token (so the next prefill is running) the bench sends
  ``SwitchCommand(decode)``. Queued prompts are handed to p0; the running prefill finishes
  and its KV export is flushed. "Overhead beyond finishing the running prefill" = time the
  bench receives the worker's ``active`` StateEvent − max(command sent, end of the prefill
  that was running, from the worker's own first-token timestamps).

Per switch: the worker's own phase durations (``RoleSwitcher.last_durations_ms``, read from
its telemetry ``switch_*_ms`` metrics), command → ``active`` event and command → registry
as the bench observed them, and the scenario's context. Engines: ``emulated`` with the
shipped Llama-3.1-8B / A100 profile (the paper's scale) and the real ``tiny`` torch engine.
Last stdout line: one JSON object with every figure and both goal checks. The two
scenarios themselves: switch_scenarios.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from services.bench.bus_client import BenchBusClient
from services.bench.switch_scenarios import Setup, d2p_under_load, p2d_under_load
from services.common.cluster import Cluster
from services.common.cluster_spec import ClusterSpec
from services.common.logging import configure_logging
from services.common.procs import ChildProcess
from shared.policy.roles import DECODE

GOAL_P2D_OVERHEAD_MS = 100.0
GOAL_D2P_MIGRATE_MS = 1000.0


def setups(quick: bool) -> dict[str, Setup]:
    if quick:
        return {"emulated": Setup("emulated", 0, 3, 1000, 4, 256, (60, 100))}
    return {
        "emulated": Setup("emulated", 0, 6, 4000, 8, 512, (1000, 2000)),
        "tiny": Setup("torch", 1, 6, 900, 8, 64, (600, 900)),
    }


async def run_engine(
    nats_url: str, s: Setup, repeats: int, repeats_no_migrate: int, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    workers = ["p0", "d0", "d1", "d2"]
    runs: dict[str, list[dict[str, Any]]] = {}
    async with BenchBusClient(nats_url) as c:
        await c.wait_workers(workers, 120.0)
        await c.wait_until(lambda: all(w in c.telemetry for w in workers), 30.0)
        for label, worker, n in (
            ("migrate", "d1", repeats),
            ("no_migrate", "d2", repeats_no_migrate),
        ):
            for _ in range(n):
                print(f"  {worker}: D->P under load ({label}) ...", file=sys.stderr)
                runs.setdefault(f"{label}.d2p", []).append(
                    await d2p_under_load(c, s, worker, rng, workers)
                )
                if runs[f"{label}.d2p"][-1]["cancelled"]:
                    continue  # still a decode worker: no P->D to measure
                print(f"  {worker}: P->D under load ...", file=sys.stderr)
                runs.setdefault(f"{label}.p2d", []).append(
                    await p2d_under_load(c, s, worker, workers)
                )
    out: dict[str, Any] = {}
    for key, rows in runs.items():
        label, kind = key.split(".")
        out.setdefault(label, {})[kind] = aggregate(rows)
    return out


def aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of every figure over the runs, plus the worst total and overhead."""
    keys = [k for k in rows[0] if not k.startswith("_")]
    out: dict[str, Any] = {"runs": len(rows)}
    for k in keys:
        vals = [r[k] for r in rows]
        summed = k in ("errors", "cancelled")
        out[k] = sum(vals) if summed else round(statistics.median(vals), 3)
    out["total_ms_max"] = max(r["total_ms"] for r in rows)
    if "overhead_beyond_prefill_ms" in rows[0]:
        out["overhead_beyond_prefill_ms_max"] = max(r["overhead_beyond_prefill_ms"] for r in rows)
    return out


# ------------------------------------------------------------------------------ cluster
def start_cluster(s: Setup, log_dir: Path) -> tuple[Cluster, ChildProcess]:
    """p0, d0, d1 (migration on) as a Cluster; d2 (``--no-migrate``) beside it."""
    secret = os.urandom(16).hex()
    common = ["--no-fluidtoken", "--heartbeat-s", "0.5"]
    spec = ClusterSpec(
        prefill=1,
        decode=2,
        model="tiny",
        engine=s.engine,
        threads=s.threads,
        with_router=False,
        with_controller=False,
        worker_args=tuple(common),
        env=(("FLUIDPD_CLUSTER_SECRET", secret), ("UCX_WARN_UNUSED_ENV_VARS", "n")),
        log_dir=log_dir,
        die_with_parent=True,
    )
    cluster = Cluster(spec)
    cluster.start()
    extra = cluster.add_worker("d2", DECODE, extra_args=("--no-migrate",))
    return cluster, extra


def run_one_engine(name: str, s: Setup, a: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    print(f"{name}: starting p0, d0, d1, d2 ...", file=sys.stderr)
    cluster, extra = start_cluster(s, log_dir / name)
    try:
        cluster.wait_ready(timeout_s=180)
        deadline = time.monotonic() + 180
        while not extra.ready.wait(0.2):  # ChildProcess exposes events, not a joint wait
            if extra.exited.is_set() or time.monotonic() > deadline:
                raise RuntimeError(f"d2 did not start:\n{extra.tail(30)}")
        return asyncio.run(
            run_engine(cluster.operator_url, s, a.repeats, a.repeats_no_migrate, a.seed)
        )
    finally:
        extra.stop(8.0)
        cluster.stop()


def goals(results: dict[str, Any]) -> dict[str, Any]:
    p2d = [
        r[label]["p2d"]["overhead_beyond_prefill_ms_max"]
        for r in results.values()
        for label in ("migrate", "no_migrate")
        if "p2d" in r.get(label, {})
    ]
    paper = results.get("emulated", {}).get("migrate", {}).get("d2p", {})
    return {
        "goal_p2d_overhead_ms": GOAL_P2D_OVERHEAD_MS,
        "goal_d2p_migrate_ms": GOAL_D2P_MIGRATE_MS,
        "p2d_overhead_beyond_prefill_ms_max": max(p2d) if p2d else None,
        "d2p_migrate_total_ms_max_paper_scale": paper.get("total_ms_max"),
        "meets_p2d_goal": bool(p2d) and max(p2d) < GOAL_P2D_OVERHEAD_MS,
        "meets_d2p_goal": bool(paper)
        and paper["cancelled"] == 0
        and paper["total_ms_max"] < GOAL_D2P_MIGRATE_MS,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fluidpd bench switch", description=__doc__.split("\n")[0])
    p.add_argument("--engines", default="", help="comma list of emulated,tiny (default both)")
    p.add_argument("--repeats", type=int, default=3, help="switch cycles with migration")
    p.add_argument("--repeats-no-migrate", type=int, default=1, help="cycles without")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="emulated only, short decodes (smoke)")
    p.add_argument("--log-dir", default="", help="keep the workers' logs here")
    a = p.parse_args(argv)
    configure_logging(service="bench", level=logging.WARNING)
    if a.quick:
        a.repeats = a.repeats_no_migrate = 1
    table = setups(a.quick)
    names = [n for n in (a.engines.split(",") if a.engines else table) if n]
    unknown = [n for n in names if n not in table]
    if unknown or a.repeats < 1 or a.repeats_no_migrate < 1:
        p.error(f"unknown engines {unknown} (have {list(table)}) or repeats < 1")
    log_dir = Path(a.log_dir) if a.log_dir else Path(tempfile.mkdtemp(prefix="fluidpd-bench-sw-"))
    results = {name: run_one_engine(name, table[name], a, log_dir) for name in names}
    out = {
        "bench": "switch",
        "results": results,
        **goals(results),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "log_dir": str(log_dir),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
