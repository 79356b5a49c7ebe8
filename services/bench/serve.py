"""``fluidpd bench serve`` (issue 4): what the router and the bus add per request and per token.

Method. An emulated 1P1D cluster runs a latency profile written for this benchmark with
known, fixed step times (prefill = c0 + c1·L with c0 = 5 ms, c1 = 1 µs/token; decode
iteration = a0 = 5 ms whatever the batch and context). N sequential streaming requests go,
request by request in turn (so all four see the same machine load), through

* the router (HTTP, ``/v1/completions``, ``fluidpd_timestamps``), with a minimal HTTP/1.1
  client (services/bench/sse_client.py: aiohttp's client cost ~0.25 ms of its own per
  request, which is neither router nor bus);
* the bus alone (``BenchBusClient``, a router stand-in, no HTTP), which splits the overhead
  into bus + workers vs router;
* the stack floor (services/bench/serve_baselines.py): the same processes and hops built
  from aiohttp + nats.py with no serving logic — what this machine charges for the hops
  themselves; ``router_minus_floor`` is FluidPD's own share;
* the engine directly: the same ``EmulatedEngine`` in this process, its steps run in a
  worker thread from the event loop exactly as a worker runs them (prefill, then one decode
  step per token). This is the baseline the goals are about: what the engine itself takes,
  thread hop and sleep overshoot under the current machine load included.

CPU layout: by default (two or more CPUs) nats-server, the router, the floor relay and this
process run on the first CPU, the workers on the others (``--control-cpus`` /
``--worker-cpus``; '' = not pinned), as ``fluidpd up --control-cpus`` would place them:
the router's work must not wait behind a worker's (docs/serve-latency.md).

Figures (ms): TTFT and the gap between consecutive tokens (the first gap, which carries the
KV hand-off, is reported apart). ``*_added_vs_direct_*`` = percentile of a path minus the
same percentile of the direct path (the goals use these); ``ttft_added_paired_*`` = the
percentiles of the per-request difference router − direct; ``*_overhead_*`` = a path minus
the profile's prediction (the older figure: it also counts the engine's overshoot).

Chunks merge tokens whose bytes are incomplete UTF-8 (the tiny tokenizer is byte-level), so
the client maps every chunk back to the tokens it carries: the reference token ids come from
the emulated engine in process (the ground truth every path must reproduce), detokenized
the way the router does. A token is timed by the chunk that first shows its text; per-token
gaps are taken between consecutive tokens that each show text at once, and TTFT only where
the first token shows text by itself.

Also reported: the engine's own sleep overshoot (``EmulatedEngine.step`` called in process
with no thread hop, vs its prediction), the worker-measured prefill span vs its prediction,
the TTFT breakdown from the router's and the workers' wall-clock stamps (client send →
router submit → bus → worker queue → prefill start, prefill end → router receive, router →
client per token; one host, one clock), and the sample counts behind every p99 (a p99 from
fewer than ~100 samples is close to the maximum). Last stdout line: one JSON object with
every figure, the goals and whether they were met, and the machine's load average (other
processes inflate every figure on a small machine).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from services.bench.serve_baselines import (
    engine_overshoot,
    reference_tokens,
    start_floor,
)
from services.bench.serve_paths import init_measuring_process, measure
from services.bench.serve_report import figures, goals
from services.bench.serve_samples import (
    DECODE_A0_S,
    PREFILL_C0_S,
    PREFILL_C1_S_PER_TOKEN,
    bench_profile,
    prompt_of,
)
from services.common.cluster import Cluster
from services.common.cluster_spec import ClusterSpec
from services.common.cpus import CpuSetError, check_cpus, parse_cpus, split_control_workers
from services.common.logging import configure_logging
from services.common.nats_server import free_port
from services.common.procs import ChildProcess, stop_all


# -------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fluidpd bench serve", description=__doc__.split("\n")[0])
    p.add_argument(
        "--requests",
        type=int,
        default=500,
        help="measured requests per path (~2/3 give a TTFT sample: the rest's first token "
        "is an incomplete UTF-8 piece; 500 puts ~5 samples above the p99)",
    )
    p.add_argument("--warmup", type=int, default=5, help="unmeasured requests first")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--engine-iters", type=int, default=200, help="in-process engine steps")
    p.add_argument("--quick", action="store_true", help="tiny run for smoke tests (< 30 s)")
    p.add_argument("--log-dir", default="", help="keep the cluster's logs here")
    p.add_argument(
        "--control-cpus",
        default="auto",
        help="CPUs for nats-server, the router and this process (client and direct path); "
        "'auto' (default): the first CPU when there are two or more; '' = not pinned",
    )
    p.add_argument(
        "--worker-cpus",
        default="auto",
        help="CPUs for the workers; 'auto' (default): all but the first; '' = not pinned",
    )
    a = p.parse_args(argv)
    if a.quick:
        a.requests, a.warmup, a.output_tokens, a.engine_iters = 8, 2, 8, 20
    if a.requests < 1 or a.output_tokens < 3 or a.prompt_tokens < 1:
        p.error("need --requests >= 1, --output-tokens >= 3, --prompt-tokens >= 1")
    auto_control, auto_workers = split_control_workers()
    try:
        a.control_cpus = (
            auto_control
            if a.control_cpus == "auto"
            else check_cpus(parse_cpus(a.control_cpus), "--control-cpus")
        )
        a.worker_cpus = (
            auto_workers
            if a.worker_cpus == "auto"
            else check_cpus(parse_cpus(a.worker_cpus), "--worker-cpus")
        )
    except CpuSetError as exc:
        p.error(str(exc))
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    configure_logging(service="bench", level=logging.WARNING)
    tmp = Path(tempfile.mkdtemp(prefix="fluidpd-bench-serve-"))
    profile_path = tmp / "profile.json"
    bench_profile().save(profile_path)
    n = a.warmup + a.requests
    prompts = [prompt_of(i, a.prompt_tokens) for i in range(n)]
    print(f"engine alone: {a.engine_iters} prefill + decode steps ...", file=sys.stderr)
    overshoot = engine_overshoot(str(profile_path), a.prompt_tokens, a.engine_iters)
    refs = reference_tokens(str(profile_path), prompts, a.output_tokens)
    spec = ClusterSpec(
        prefill=1,
        decode=1,
        model="tiny",
        engine="emulated",
        profile=str(profile_path),
        port=0,
        with_controller=False,
        log_dir=Path(a.log_dir) if a.log_dir else tmp / "logs",
        die_with_parent=True,
        control_cpus=a.control_cpus,
        worker_cpus=a.worker_cpus,
    )
    if a.worker_cpus:
        # This process only pumps the children's log lines from here on: on the workers'
        # CPUs, not the control plane's (threads started from here on inherit this).
        os.sched_setaffinity(0, a.worker_cpus)
    cluster = Cluster(spec)
    floor: list[ChildProcess] = []
    try:
        print("starting an emulated 1P1D cluster and the stack floor ...", file=sys.stderr)
        cluster.start()
        cluster.wait_ready(timeout_s=120)
        floor_port = free_port()  # the floor relay cannot report its port
        floor = start_floor(
            cluster.operator_url,
            str(profile_path),
            floor_port,
            control_cpus=a.control_cpus,
            worker_cpus=a.worker_cpus,
            sink=cluster.sink,
        )
        print(
            f"router, bus, floor and direct paths in turn: {n} requests each ...", file=sys.stderr
        )
        # The client and the direct path run in a process of their own on the control
        # plane's CPUs, so the log pumping above never holds the GIL a measurement needs.
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(1, initializer=init_measuring_process, initargs=(a.control_cpus,)) as pool:
            routed, bus, floor_s, direct, bad = pool.apply(
                measure,
                (
                    cluster.router_url,
                    f"http://127.0.0.1:{floor_port}",
                    cluster.operator_url,
                    prompts,
                    refs,
                    str(profile_path),
                    a,
                ),
            )
    finally:
        stop_all(floor, grace_s=2.0)
        cluster.stop()
    out: dict[str, Any] = {"bench": "serve"}
    out |= figures(routed, bus, floor_s, direct)
    out |= overshoot
    out |= {
        "requests": a.requests,
        "mismatched_streams": bad,
        "prompt_tokens": a.prompt_tokens,
        "output_tokens": a.output_tokens,
        "engine_prefill_ms": round(
            (PREFILL_C0_S + PREFILL_C1_S_PER_TOKEN * a.prompt_tokens) * 1e3, 3
        ),
        "engine_decode_iter_ms": DECODE_A0_S * 1e3,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "control_cpus": list(a.control_cpus),
        "worker_cpus": list(a.worker_cpus),
    }
    out |= goals(out)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
