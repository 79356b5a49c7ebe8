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
Last stdout line: one JSON object with every figure and both goal checks.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.bench.bus_client import BenchBusClient
from services.common.cluster import WORKER_READY, Cluster, ClusterSpec
from services.common.logging import configure_logging
from services.common.procs import ChildProcess
from shared.policy.roles import ACTIVE, DECODE, PREFILL, Role

GOAL_P2D_OVERHEAD_MS = 100.0
GOAL_D2P_MIGRATE_MS = 1000.0
PHASES = ("drain_ms", "reslice_ms", "route_update_ms")


@dataclass(frozen=True)
class Setup:
    """Load shape for one engine. Validated by construction in ``setups``."""

    engine: str  # ClusterSpec engine
    threads: int
    p2d_prompts: int
    p2d_prompt_tokens: int
    d2p_requests: int
    d2p_prompt_tokens: int
    d2p_output_tokens: tuple[int, int]


def setups(quick: bool) -> dict[str, Setup]:
    if quick:
        return {"emulated": Setup("emulated", 0, 3, 1000, 4, 256, (60, 100))}
    return {
        "emulated": Setup("emulated", 0, 6, 4000, 8, 512, (1000, 2000)),
        "tiny": Setup("torch", 1, 6, 900, 8, 64, (600, 900)),
    }


def prompt_of(index: int, length: int) -> list[int]:
    return [4 + (index * 131 + i * 17) % 300 for i in range(length)]


# ------------------------------------------------------------------------ one switch
async def switch_and_measure(
    c: BenchBusClient, worker: str, to_role: Role, timeout_s: float
) -> dict[str, Any]:
    """Send the command, wait for the ``active`` event, the registry and the telemetry with
    the new durations. Raises RuntimeError when the worker refuses or cancels the switch."""
    assert c.watcher is not None
    before = c.telemetry[worker].metrics.get("switches_total", 0.0)
    first_event = len(c.events)
    t_cmd, t_cmd_wall = time.perf_counter(), time.time()
    reply = await c.switch(worker, to_role)
    if not reply.ok:
        raise RuntimeError(f"switch {worker} -> {to_role} refused: {reply.error}")

    def active() -> Any:
        for ev in c.events[first_event:]:
            e = ev.event
            if e.publisher_id == worker and e.to_state == ACTIVE:
                return ev
        return None

    await c.wait_until(lambda: active() is not None, timeout_s)
    done = active()
    observed_ms = round((done.recv_s - t_cmd) * 1e3, 3)
    if done.event.role != to_role:  # the drain deadline passed: the worker stayed as it was
        print(f"  switch of {worker} cancelled: {done.event.reason}", file=sys.stderr)
        return {
            **{k: 0.0 for k in PHASES},
            "drain_ms": observed_ms,
            "total_ms": observed_ms,
            "command_to_active_ms": observed_ms,
            "command_to_registry_ms": observed_ms,
            "cancelled": 1,
            "_t_cmd_wall": t_cmd_wall,
            "_t_active_wall": done.recv_wall_s,
        }
    await c.watcher.wait_until(
        lambda w: (r := w.get(worker)) is not None and r.role == to_role and r.state == ACTIVE,
        10.0,
    )
    t_registry = time.perf_counter()
    await c.wait_until(
        lambda: c.telemetry[worker].metrics.get("switches_total", 0.0) > before, 10.0
    )
    m = c.telemetry[worker].metrics
    out = {k: round(m.get(f"switch_{k}", float("nan")), 3) for k in PHASES}
    out["total_ms"] = round(sum(out[k] for k in PHASES), 3)
    out["command_to_active_ms"] = observed_ms
    out["command_to_registry_ms"] = round((t_registry - t_cmd) * 1e3, 3)
    out["cancelled"] = 0
    out["_t_cmd_wall"] = t_cmd_wall
    out["_t_active_wall"] = done.recv_wall_s
    return out


async def wait_idle(c: BenchBusClient, workers: list[str]) -> None:
    """Until no decode work runs or is being received anywhere (telemetry)."""
    await c.wait_until(
        lambda: all(
            w in c.telemetry
            and c.telemetry[w].running == 0
            and c.telemetry[w].metrics.get("receiving", 0.0) == 0
            and c.telemetry[w].queue_len == 0
            for w in workers
        ),
        120.0,
    )


# -------------------------------------------------------------------------- scenarios
async def d2p_under_load(
    c: BenchBusClient, s: Setup, worker: str, rng: random.Random, all_workers: list[str]
) -> dict[str, Any]:
    lo, hi = s.d2p_output_tokens
    lengths = [rng.randint(lo, hi) for _ in range(s.d2p_requests)]
    rids = [
        await c.submit("p0", worker, prompt_of(i, s.d2p_prompt_tokens), n, seed=i)
        for i, n in enumerate(lengths)
    ]
    await c.wait_until(lambda: all(len(c.streams[r].token_ids) >= 5 for r in rids), 120.0)
    moved_before = c.telemetry[worker].metrics.get("migrations_out_total", 0.0)
    remaining = [n - len(c.streams[r].token_ids) for r, n in zip(rids, lengths, strict=True)]
    out = await switch_and_measure(c, worker, PREFILL, timeout_s=120.0)
    got = {r: len(c.streams[r].token_ids) for r in rids}
    # Streams must go on (migrated) or be complete (drained): none may fail.
    await c.wait_until(
        lambda: all(
            c.streams[r].finish_reason is not None or len(c.streams[r].token_ids) > got[r]
            for r in rids
        ),
        30.0,
    )
    errors = sum(1 for r in rids if c.streams[r].error is not None)
    out |= {
        "requests": len(rids),
        "remaining_tokens_max": max(remaining),
        "migrated": int(
            c.telemetry[worker].metrics.get("migrations_out_total", 0.0) - moved_before
        ),
        "errors": errors,
    }
    for r in rids:  # the migrated ones would run for many seconds more: end them
        if c.streams[r].finish_reason is None:
            await c.cancel(r, [w for w in all_workers if w != "p0"])
    await wait_idle(c, all_workers)
    return out


async def p2d_under_load(
    c: BenchBusClient, s: Setup, worker: str, all_workers: list[str]
) -> dict[str, Any]:
    rids = [
        await c.submit(worker, "d0", prompt_of(100 + i, s.p2d_prompt_tokens), 4, seed=i)
        for i in range(s.p2d_prompts)
    ]
    # Right after the first prompt's first token, the worker is running the second prefill.
    await c.wait_until(lambda: len(c.streams[rids[0]].token_ids) >= 1, 60.0)
    out = await switch_and_measure(c, worker, DECODE, timeout_s=60.0)
    for r in rids:
        await c.result(r, 120.0)
    t_cmd = out["_t_cmd_wall"]
    ends = [
        st.timestamps["prefill_end_s"]
        for st in (c.streams[r] for r in rids)
        if st.publishers and st.publishers[0] == worker and "prefill_end_s" in st.timestamps
    ]
    running_end = max([t_cmd, *ends])
    out |= {
        "requests": len(rids),
        "handed_off": sum(1 for r in rids if c.streams[r].publishers[:1] == ["p0"]),
        "running_prefill_remaining_ms": round((running_end - t_cmd) * 1e3, 3),
        "overhead_beyond_prefill_ms": round((out["_t_active_wall"] - running_end) * 1e3, 3),
        "errors": sum(1 for r in rids if c.streams[r].error is not None),
    }
    await wait_idle(c, all_workers)
    return out


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
    argv = [spec.python, "-m", "services.decode_worker", "--id", "d2", "--nats", cluster.nats_url]
    argv += ["--model", "tiny", "--engine", s.engine, "--no-migrate", *common]
    if s.threads:
        argv += ["--threads", str(s.threads)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **dict(spec.env)}
    extra = ChildProcess(
        "d2", argv, env=env, ready_marker=WORKER_READY, sink=cluster.sink, die_with_parent=True
    )
    extra.start()
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
        return asyncio.run(run_engine(cluster.nats_url, s, a.repeats, a.repeats_no_migrate, a.seed))
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
