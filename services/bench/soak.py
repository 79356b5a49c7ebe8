"""``fluidpd bench soak``: a long run of the emulated 8-worker cluster under moderate load
with periodic role switches; reports RSS growth per process, leaked KV blocks, failed and
hung requests.

Method. ``fluidpd up``'s cluster (4 prefill + 4 decode emulated workers, model ``tiny``,
``--time-scale``), an open-loop Poisson load of synthetic streaming requests
(services/bench/loadgen.py) for ``--duration-s``, and every ``--switch-every-s`` a
``SwitchCommand`` over the bus (what ``fluidpd ctl switch`` sends) that moves one worker
to the other role, alternating P→D and D→P so neither role empties (``--auto`` lets the
controller decide instead). Every ``--sample-s`` the RSS of every process is read
(psutil). Baseline: the sample at ``--baseline-s`` (default: the end of the first minute,
after warm-up); end: the last sample under load. After the load, the run waits until every
worker reports all its KV blocks free (telemetry) — what is still held is leaked.

Goals: 0 leaked blocks, 0 hung requests (no answer within ``--request-timeout-s``), RSS
growth < 5 % for every FluidPD process (nats-server's RSS is reported, not judged). Last
stdout line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from services.bench.loadgen import PlannedRequest, RequestRecord, run_open_loop
from services.common.cluster import Cluster
from services.common.cluster_spec import ClusterSpec
from services.common.logging import configure_logging
from shared.bus import Bus, BusConfig
from shared.bus.registry_watcher import RegistryWatcher
from shared.messages import Subjects, SwitchCommand, SwitchReply, WorkerTelemetry
from shared.policy.roles import ACTIVE, DECODE, PREFILL, ROLES, Role

GOAL_RSS_GROWTH_PCT = 5.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fluidpd bench soak", description=__doc__.split("\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--prefill", type=int, default=4)
    p.add_argument("--decode", type=int, default=4)
    p.add_argument("--time-scale", type=float, default=0.2)
    p.add_argument("--rps", type=float, default=4.0, help="mean arrival rate (Poisson)")
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=(64, 1024), metavar=("MIN", "MAX"))
    p.add_argument("--output-tokens", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    p.add_argument("--switch-every-s", type=float, default=20.0, help="0: no manual switches")
    p.add_argument("--auto", action="store_true", help="let the controller switch (FluidRole)")
    p.add_argument("--num-kv-blocks", type=int, default=4096)
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--baseline-s", type=float, default=60.0)
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--drain-timeout-s", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-dir", type=Path, default=None)
    return p


def plan_requests(args: argparse.Namespace) -> list[PlannedRequest]:
    rng = random.Random(args.seed)
    plan, t = [], rng.expovariate(args.rps)
    while t < args.duration_s:
        plan.append(
            PlannedRequest(
                t, rng.randint(*args.prompt_tokens), rng.randint(*args.output_tokens), "soak"
            )
        )
        t += rng.expovariate(args.rps)
    return plan


class Monitor:
    """Telemetry (free blocks), registry (roles) and switch commands over the bus."""

    def __init__(self, nats_url: str) -> None:
        self.subjects = Subjects()
        self.bus = Bus(BusConfig.from_url(nats_url, name="soak"), self.subjects)
        self.watcher = RegistryWatcher(self.bus)
        self.telemetry: dict[str, WorkerTelemetry] = {}
        self.switches_ok = 0
        self.switches_refused = 0
        self._flip = 0

    async def start(self) -> None:
        await self.bus.start()
        await self.watcher.start()

        async def on_telemetry(msg: WorkerTelemetry) -> None:
            self.telemetry[msg.publisher_id] = msg

        await self.bus.subscribe_stream(
            self.subjects.telemetry_all(), WorkerTelemetry, on_telemetry
        )

    async def stop(self) -> None:
        await self.watcher.stop()
        await self.bus.stop()

    async def switch_one(self) -> None:
        """Move one active worker to the other role, alternating directions; the side
        that gives a worker keeps at least one."""
        active = {r: self.watcher.workers(role=r, state=ACTIVE) for r in ROLES}
        src: Role = ROLES[self._flip % 2]
        dst: Role = DECODE if src == PREFILL else PREFILL
        if len(active[src]) < 2:
            src, dst = dst, src
        if len(active[src]) < 2:
            return
        self._flip += 1
        worker = random.choice(active[src]).worker_id
        try:
            reply = await self.bus.request(
                self.subjects.worker_switch(worker), SwitchCommand(role=dst), SwitchReply, 5.0
            )
        except Exception:
            self.switches_refused += 1
            return
        if reply.ok:
            self.switches_ok += 1
        else:
            self.switches_refused += 1

    async def switcher(self, every_s: float, until_s: float) -> None:
        while time.monotonic() + every_s < until_s:
            await asyncio.sleep(every_s)  # the switch schedule itself, not a sync
            await self.switch_one()

    def held_blocks(self) -> dict[str, int]:
        return {
            w: t.total_blocks - t.free_blocks
            for w, t in self.telemetry.items()
            if t.free_blocks != t.total_blocks or t.running or t.queue_len
        }

    async def wait_all_free(self, timeout_s: float) -> dict[str, int]:
        deadline = time.monotonic() + timeout_s
        while self.held_blocks() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)  # telemetry arrives every ~20 ms; a poll interval
        return self.held_blocks()


async def sample_rss(
    pids: dict[str, int], every_s: float, until_s: float, out: list[tuple[float, dict[str, int]]]
) -> None:
    """Append (seconds since start, name -> RSS bytes) every ``every_s`` until ``until_s``."""
    procs = {name: psutil.Process(pid) for name, pid in pids.items()}
    t0 = time.monotonic()
    while True:
        sample = {}
        for name, proc in procs.items():
            try:
                sample[name] = proc.memory_info().rss
            except psutil.Error:
                sample[name] = 0
        out.append((time.monotonic() - t0, sample))
        if time.monotonic() + every_s > until_s:
            return
        await asyncio.sleep(every_s)  # the sampling period, not a sync


def rss_report(
    samples: list[tuple[float, dict[str, int]]], baseline_s: float
) -> dict[str, dict[str, float]]:
    base = next((s for t, s in samples if t >= baseline_s), samples[-1][1])
    end = samples[-1][1]
    report = {}
    for name, b in base.items():
        e = end.get(name, 0)
        report[name] = {
            "base_mb": round(b / 2**20, 1),
            "end_mb": round(e / 2**20, 1),
            "growth_pct": round((e - b) / b * 100, 2) if b else 0.0,
        }
    return report


async def run(args: argparse.Namespace, cluster: Cluster) -> dict[str, Any]:
    from shared.tokenizer.models import load_tokenizer

    vocab = load_tokenizer("tiny").vocab_size
    monitor = Monitor(cluster.operator_url)
    await monitor.start()
    try:
        plan = plan_requests(args)
        t_end = time.monotonic() + args.duration_s
        samples: list[tuple[float, dict[str, int]]] = []
        sampler = asyncio.ensure_future(sample_rss(cluster.pids(), args.sample_s, t_end, samples))
        switcher = None
        if args.switch_every_s > 0 and not args.auto:
            switcher = asyncio.ensure_future(monitor.switcher(args.switch_every_s, t_end))
        records: list[RequestRecord] = await run_open_loop(
            cluster.router_url,
            "tiny",
            plan,
            vocab_size=vocab,
            timeout_s=args.request_timeout_s,
            progress=False,
        )
        await sampler
        if switcher is not None:
            switcher.cancel()
        held = await monitor.wait_all_free(args.drain_timeout_s)
    finally:
        await monitor.stop()
    hung = [r for r in records if r.error and r.error.startswith("TimeoutError")]
    failed = [r for r in records if r.error and r not in hung]
    rss = rss_report(samples, min(args.baseline_s, args.duration_s / 4))
    # The goal is for FluidPD's processes; nats-server (a Go heap, JetStream) is reported apart.
    max_growth = max((v["growth_pct"] for k, v in rss.items() if k != "nats"), default=0.0)
    leaked = sum(held.values())
    return {
        "bench": "soak",
        "duration_s": args.duration_s,
        "workers": f"{args.prefill}P{args.decode}D",
        "time_scale": args.time_scale,
        "rps": args.rps,
        "requests": len(records),
        "completed": len(records) - len(failed) - len(hung),
        "failed": len(failed),
        "hung": len(hung),
        "failed_examples": sorted({(r.error or "")[:120] for r in failed})[:5],
        "switches_ok": monitor.switches_ok,
        "switches_refused": monitor.switches_refused,
        "leaked_blocks": leaked,
        "held_by_worker": held,
        "rss": rss,
        "max_rss_growth_pct": max_growth,
        "nats_rss_growth_pct": rss.get("nats", {}).get("growth_pct"),
        "goals": {"leaked_blocks": 0, "hung": 0, "rss_growth_pct_below": GOAL_RSS_GROWTH_PCT},
        "goals_met": leaked == 0 and not hung and max_growth < GOAL_RSS_GROWTH_PCT,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(False, "soak")  # to stderr: the JSON summary is stdout's last line
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="fluidpd-soak-"))
    spec = ClusterSpec(
        prefill=args.prefill,
        decode=args.decode,
        model="tiny",
        engine="emulated",
        port=0,
        time_scale=args.time_scale,
        auto_policy=args.auto,
        worker_args=("--num-kv-blocks", str(args.num_kv_blocks)),
        router_args=("--request-timeout-s", str(args.request_timeout_s)),
        log_dir=log_dir,
    )
    cluster = Cluster(spec)
    try:
        cluster.start()
        cluster.wait_ready(timeout_s=300)
        print(f"soak: cluster ready, logs in {log_dir}", file=sys.stderr)
        summary = asyncio.run(run(args, cluster))
    finally:
        exits = cluster.stop()
    summary["exit_codes"] = exits
    summary["log_dir"] = str(log_dir)
    print(json.dumps(summary))
    return 0 if summary["goals_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
