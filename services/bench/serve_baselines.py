"""``fluidpd bench serve``'s two baselines.

* ``DirectEngine``: the emulated engine in the bench process, stepped from the event loop
  through one worker thread as a worker steps it — no router, no bus, no second process.
  The goals ("time added") are measured against it.
* The **stack floor**: the same process layout and hops as the routed path (client ->
  HTTP relay -> nats-server -> worker process, engine thread, -> nats-server -> relay ->
  client) built from the libraries the router and the workers are built on (aiohttp +
  uvloop, nats.py) with no serving logic at all: the relay forwards the raw body and
  writes each token as one SSE chunk; the stand-in worker runs the same ``EmulatedEngine``
  steps through one thread and publishes each token as it comes. What the floor adds over
  the direct path is what this machine charges for the hops themselves; what the router
  adds over the floor is FluidPD's own share (validation, typed messages, admission, KV
  hand-off, telemetry, logging).

Run as ``python -m services.bench.serve_baselines relay|worker --nats URL ...``; each
prints ``READY_LINE`` once it is subscribed and listening.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from services.bench.serve_samples import SEED, pct, prompt_of
from services.common.procs import ChildProcess, LogSink, stop_all
from services.common.service import announce_ready
from shared.aio import run
from shared.messages import Subjects

READY_LINE = "bench floor ready"
_LAST_TOKEN = b"last:"  # prefix of a stream's final token message


# ------------------------------------------------------------------ engine in process
def engine_overshoot(profile_path: str, prompt_tokens: int, iters: int) -> dict[str, Any]:
    """``EmulatedEngine.step`` in process: measured − predicted (ms), prefill and decode."""
    from shared.engine.batch import StepInput
    from shared.engine.emulated import EmulatedConfig, EmulatedEngine
    from shared.engine.engine import SampleSpec
    from shared.sampling_params import SamplingParams

    eng = EmulatedEngine.load(EmulatedConfig(model="tiny", profile_path=profile_path))
    bm = eng.block_manager
    spec = SampleSpec(SamplingParams(max_tokens=iters + 1), 0, SEED)
    pre, dec = [], []
    for k in range(iters):
        bm.allocate("x", prompt_tokens + 2)
        table = bm.block_table("x")
        steps = [StepInput("x", prompt_of(k, prompt_tokens), 0, table)]
        t0 = time.perf_counter()
        eng.step(steps, [spec])
        pre.append((time.perf_counter() - t0 - eng.predict_step_s(steps)) * 1e3)
        steps = [StepInput("x", [42], prompt_tokens, table)]
        t0 = time.perf_counter()
        eng.step(steps, [spec])
        dec.append((time.perf_counter() - t0 - eng.predict_step_s(steps)) * 1e3)
        bm.free_sequence("x")
    return {
        "engine_prefill_overshoot_ms_p50": pct(pre, 0.5),
        "engine_prefill_overshoot_ms_p99": pct(pre, 0.99),
        "engine_decode_overshoot_ms_p50": pct(dec, 0.5),
        "engine_decode_overshoot_ms_p99": pct(dec, 0.99),
    }


def reference_tokens(
    profile_path: str, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """The emulated engine's greedy output for each prompt (seed ``SEED``), in process and
    without its sleeps: the tokens every path must deliver."""
    from shared.engine.emulated import EmulatedConfig, EmulatedEngine
    from shared.engine.generate import generate
    from shared.sampling_params import SamplingParams

    eng = EmulatedEngine.load(
        EmulatedConfig(model="tiny", profile_path=profile_path, time_scale=1e-6)
    )
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=SEED)
    return [o.token_ids for o in generate(eng, prompts, params)]  # type: ignore[arg-type]


class DirectEngine:
    """The emulated engine stepped through one worker thread (see module doc)."""

    def __init__(self, profile_path: str, thread_name: str = "bench-engine") -> None:
        from shared.engine.emulated import EmulatedConfig, EmulatedEngine

        self.engine = EmulatedEngine.load(EmulatedConfig(model="tiny", profile_path=profile_path))
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=thread_name)
        self._n = 0

    def close(self) -> None:
        self.executor.shutdown(wait=True)

    async def stream(self, prompt: list[int], max_tokens: int) -> AsyncIterator[int]:
        """Prefill, then one decode step per token; yields each token as its step ends."""
        from shared.engine.batch import StepInput
        from shared.engine.engine import SampleSpec
        from shared.sampling_params import SamplingParams

        loop = asyncio.get_running_loop()
        bm = self.engine.block_manager
        self._n += 1
        sid = f"direct-{self._n}"
        bm.allocate(sid, len(prompt) + max_tokens)
        table = bm.block_table(sid)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=SEED)
        pos, chunk = 0, list(prompt)
        try:
            for k in range(max_tokens):
                step = StepInput(sid, chunk, pos, table)
                spec = SampleSpec(params, k, SEED)
                (tok,) = await loop.run_in_executor(self.executor, self.engine.step, [step], [spec])
                yield int(tok)  # type: ignore[arg-type]
                pos += len(chunk)
                chunk = [int(tok)]  # type: ignore[arg-type]
        finally:
            bm.free_sequence(sid)

    async def run(self, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """Returns (tokens, seconds from the start to each token)."""
        tokens: list[int] = []
        times: list[float] = []
        started = time.perf_counter()
        async for tok in self.stream(prompt, max_tokens):
            times.append(time.perf_counter() - started)
            tokens.append(tok)
        return tokens, times


# ------------------------------------------------------------------------- floor relay
async def run_relay(nats_url: str, host: str, port: int, subjects: Subjects) -> None:
    """HTTP in, bus out and back; one request at a time is all the bench sends."""
    import nats
    from aiohttp import web

    nc = await nats.connect(nats_url)
    queues: dict[int, asyncio.Queue[bytes]] = {}

    async def on_token(msg: Any) -> None:
        rid, _, payload = msg.data.partition(b" ")
        queue = queues.get(int(rid))
        if queue is not None:
            queue.put_nowait(payload)

    await nc.subscribe(subjects.bench_floor("tokens"), cb=on_token)
    counter = 0

    async def completions(request: web.Request) -> web.StreamResponse:
        nonlocal counter
        body = await request.read()
        counter += 1
        rid = counter
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        queues[rid] = queue
        try:
            await nc.publish(subjects.bench_floor("requests"), b"%d %s" % (rid, body))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            while True:
                payload = await queue.get()
                last = payload.startswith(_LAST_TOKEN)
                token = payload[len(_LAST_TOKEN) :] if last else payload
                await resp.write(b'data: {"choices":[{"text":"%s"}]}\n\n' % token)
                if last:
                    break
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            del queues[rid]

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    announce_ready(READY_LINE)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await nc.close()


# ------------------------------------------------------------------------ floor worker
async def run_worker(nats_url: str, profile_path: str, subjects: Subjects) -> None:
    """Bus in, engine steps in a thread, one bus message per token."""
    import nats

    engine = DirectEngine(profile_path, thread_name="floor-engine")
    nc = await nats.connect(nats_url)
    tokens_subject = subjects.bench_floor("tokens")
    tasks: set[asyncio.Task[None]] = set()

    async def serve(rid: bytes, body: dict[str, Any]) -> None:
        max_tokens = int(body["max_tokens"])
        k = 0
        async for tok in engine.stream(list(body["prompt"]), max_tokens):
            k += 1
            last = _LAST_TOKEN if k == max_tokens else b""
            await nc.publish(tokens_subject, b"%s %s%d" % (rid, last, tok))

    async def on_request(msg: Any) -> None:
        rid, _, body = msg.data.partition(b" ")
        task = asyncio.ensure_future(serve(rid, json.loads(body)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    await nc.subscribe(subjects.bench_floor("requests"), cb=on_request)
    await nc.flush()
    announce_ready(READY_LINE)
    try:
        await asyncio.Event().wait()
    finally:
        await nc.close()
        engine.close()


def start_floor(
    nats_url: str,
    profile_path: str,
    port: int,
    *,
    control_cpus: tuple[int, ...],
    worker_cpus: tuple[int, ...],
    sink: LogSink,
    timeout_s: float = 60.0,
) -> list[ChildProcess]:
    """Spawn the floor relay (on the control plane's CPUs) and worker (on the workers')
    and wait until both are ready. The caller stops them (``stop_all``). Raises
    RuntimeError if one exits or is not ready in time (both are stopped then)."""
    py = [sys.executable, "-m", "services.bench.serve_baselines"]
    children = [
        ChildProcess(
            "floor-relay",
            [*py, "relay", "--nats", nats_url, "--port", str(port)],
            ready_marker=READY_LINE,
            sink=sink,
            die_with_parent=True,
            cpus=control_cpus,
        ),
        ChildProcess(
            "floor-worker",
            [*py, "worker", "--nats", nats_url, "--profile", profile_path],
            ready_marker=READY_LINE,
            sink=sink,
            die_with_parent=True,
            cpus=worker_cpus,
        ),
    ]
    deadline = time.monotonic() + timeout_s
    try:
        for child in children:
            child.start()
        for child in children:
            if not child.ready.wait(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"{child.name} not ready: {child.tail(20)}")
    except BaseException:
        stop_all(children, grace_s=2.0)
        raise
    return children


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.bench.serve_baselines")
    p.add_argument("part", choices=("relay", "worker"))
    p.add_argument("--nats", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--profile", default="")
    p.add_argument("--subject-prefix", default="fluidpd")
    a = p.parse_args(argv)
    subjects = Subjects(a.subject_prefix)
    if a.part == "relay":
        run(run_relay(a.nats, a.host, a.port, subjects))
    else:
        run(run_worker(a.nats, a.profile, subjects))
    return 0


if __name__ == "__main__":
    sys.exit(main())
