"""Helpers for the fault, fuzz and security suites: a real cluster per case, HTTP requests
with hard client deadlines (so a hang is *measured*, never waited out), free-block checks
from worker telemetry, and a collector that prints the fault table.

Outcome of one request (``Outcome.kind``):

* ``completed`` — every token asked for arrived and the stream ended with ``length``;
* ``failed`` — it ended with an OpenAI-style error (HTTP 4xx/5xx or an SSE error event);
* ``timed_out`` — the router's own request deadline ended it (504 / ``request_timeout``):
  bounded, but it means nothing else noticed the fault;
* ``disconnected`` — the test closed the connection on purpose;
* ``hung`` — the client deadline passed with the request still open (must never happen).
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from services.common.cluster import Cluster
from services.common.cluster_spec import ClusterSpec
from tests.support.workers import REPO, BusClient, worker_env
from tests.support.workers import wait_healthy as wait_router_healthy

TINY_VOCAB = 356  # the tiny model's vocabulary (ids 0..3 are specials)
FAULT_WORKER_ARGS = ("--heartbeat-s", "0.3", "--transfer-timeout-s", "2", "--block-size", "16")


# --------------------------------------------------------------------------- cluster
@contextmanager
def fault_cluster(
    log_dir: Path,
    *,
    prefill: int = 1,
    decode: int = 1,
    num_kv_blocks: int = 2048,
    time_scale: float = 1.0,
    nats_url: str | None = None,
    extra_worker_args: Sequence[str] = (),
    router_args: Sequence[str] = ("--request-timeout-s", "15", "--pairing", "round_robin"),
    env: Sequence[tuple[str, str]] = (),
    log_json: bool = False,
    with_controller: bool = True,
    controller_args: Sequence[str] = (),
) -> Iterator[Cluster]:
    """A started, ready cluster of emulated workers (model ``tiny``); stopped on exit.

    The controller runs with ``--no-auto``: tests issue every switch themselves."""
    spec = ClusterSpec(
        prefill=prefill,
        decode=decode,
        model="tiny",
        engine="emulated",
        port=0,
        nats_url=nats_url,
        time_scale=time_scale,
        auto_policy=False,
        log_json=log_json,
        worker_args=(*FAULT_WORKER_ARGS, "--num-kv-blocks", str(num_kv_blocks), *extra_worker_args),
        router_args=tuple(router_args),
        controller_args=tuple(controller_args),
        env=tuple(env),
        log_dir=log_dir,
        with_controller=with_controller,
        stop_grace_s=5.0,
    )
    cluster = Cluster(spec)
    try:
        cluster.start()
        cluster.wait_ready(timeout_s=90)
        yield cluster
    finally:
        cluster.stop()


def spawn_worker(cluster: Cluster, worker_id: str, role: str) -> None:
    """Start one more worker in ``cluster`` (same flags as the others); ``cluster.stop()``
    stops it too. Returns at once; wait for it with ``BusClient.wait_workers``."""
    cluster.add_worker(worker_id, role)


def prompt(index: int, length: int) -> list[int]:
    """A deterministic prompt of token ids of the tiny vocabulary."""
    rng = random.Random(index * 7919 + length)
    return [rng.randrange(4, TINY_VOCAB) for _ in range(length)]


# --------------------------------------------------------------------------- requests
@dataclass
class Outcome:
    kind: str = "hung"  # completed | failed | timed_out | disconnected | hung
    status: int = 0
    tokens: int = 0
    error_code: str | None = None
    error: str | None = None
    retry_after: str | None = None
    first_token_s: float | None = None
    ended_s: float | None = None


@dataclass
class Disconnect:
    """When the client drops the connection: after ``after_s`` seconds, or once
    ``after_tokens`` tokens arrived (whichever is set)."""

    after_s: float | None = None
    after_tokens: int | None = None


async def completion(
    session: aiohttp.ClientSession,
    url: str,
    prompt_ids: Sequence[int],
    max_tokens: int,
    *,
    deadline_s: float = 25.0,
    stream: bool = True,
    disconnect: Disconnect | None = None,
) -> Outcome:
    """One /v1/completions request with a hard client deadline. Never raises."""
    out = Outcome()
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": list(prompt_ids),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    t0 = time.monotonic()

    async def run() -> None:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            out.status = resp.status
            out.retry_after = resp.headers.get("Retry-After")
            if resp.status != 200:
                _set_error(out, await resp.text())
                return
            if not stream:
                data = await resp.json()
                out.tokens = int(data["usage"]["completion_tokens"])
                finish = data["choices"][0]["finish_reason"]
                out.kind = (
                    "completed" if finish == "length" and out.tokens == max_tokens else "failed"
                )
                return
            seen = 0
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    _set_error(out, json.dumps(chunk))
                    return
                if chunk.get("usage"):
                    out.tokens = int(chunk["usage"]["completion_tokens"])
                for choice in chunk.get("choices", []):
                    seen += 1
                    if out.first_token_s is None:
                        out.first_token_s = time.monotonic() - t0
                    if choice.get("finish_reason") == "length":
                        out.kind = "completed"
                after = disconnect.after_tokens if disconnect else None
                if after is not None and seen >= after:
                    out.kind = "disconnected"
                    return  # leaving the context manager closes the connection
            if out.kind == "completed" and out.tokens != max_tokens:
                out.kind = "failed"
                out.error = f"ended with {out.tokens} of {max_tokens} tokens"

    task = asyncio.ensure_future(run())
    limit = deadline_s
    if disconnect and disconnect.after_s is not None:
        limit = disconnect.after_s
    try:
        await asyncio.wait_for(asyncio.shield(task), limit)
    except TimeoutError:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if disconnect and disconnect.after_s is not None and out.kind == "hung":
            out.kind = "disconnected"
    except (aiohttp.ClientError, OSError) as exc:
        out.kind = "failed"
        out.error = f"{type(exc).__name__}: {exc}"
    out.ended_s = time.monotonic() - t0
    return out


def _set_error(out: Outcome, text: str) -> None:
    try:
        err = json.loads(text)["error"]
        out.error_code = err.get("code")
        out.error = str(err.get("message"))[:300]
    except (ValueError, KeyError, TypeError):
        out.error = text[:300]
    out.kind = "timed_out" if out.error_code == "request_timeout" else "failed"


async def serves_new_requests(url: str, n: int = 2, *, prompt_len: int = 64) -> list[Outcome]:
    """``n`` fresh requests after a fault; the caller asserts they completed."""
    async with aiohttp.ClientSession() as session:
        return list(
            await asyncio.gather(
                *(completion(session, url, prompt(9000 + i, prompt_len), 8) for i in range(n))
            )
        )


async def ctl_status_ids(nats_url: str) -> set[str]:
    """The worker ids `fluidpd ctl status --json` lists (the CLI, in a subprocess)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "services.cli.ctl", "status", "--json", "--nats", nats_url),
        cwd=REPO,
        env=worker_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return {row["id"] for row in json.loads(out)}


async def wait_ctl_status(nats_url: str, want: set[str], timeout_s: float = 20.0) -> None:
    """Poll `fluidpd ctl status` until it lists exactly ``want`` (the controller learns of a
    dead worker from the registry within 3 heartbeat periods; there is no event to await
    from outside its process). Raises AssertionError with the last listing on timeout."""
    deadline = time.monotonic() + timeout_s
    while (got := await ctl_status_ids(nats_url)) != want:
        assert time.monotonic() < deadline, f"ctl status lists {sorted(got)}, want {sorted(want)}"
        await asyncio.sleep(0.2)


async def wait_healthy(url: str, timeout_s: float = 20.0) -> None:
    """``workers.wait_healthy`` off the event loop. Raises TimeoutError."""
    await asyncio.to_thread(wait_router_healthy, url, timeout_s)


# --------------------------------------------------------------------------- blocks
async def leaked_blocks(
    client: BusClient, worker_ids: Sequence[str], timeout_s: float = 12.0
) -> dict[str, int]:
    """Wait until every worker of ``worker_ids`` reports all blocks free and no work;
    return worker -> blocks still held at the deadline (empty dict: nothing leaked)."""

    def held() -> dict[str, int]:
        out = {}
        for w in worker_ids:
            t = client.telemetry.get(w)
            if t is None:
                out[w] = -1  # never heard of: counts as a failure of the check
            elif t.free_blocks != t.total_blocks or t.queue_len or t.running:
                out[w] = t.total_blocks - t.free_blocks
        return out

    deadline = time.monotonic() + timeout_s
    while held() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # telemetry arrives every ~20 ms; this is a poll interval
    return {w: max(0, n) if n >= 0 else n for w, n in held().items()}


def sigkill(cluster: Cluster, worker_id: str) -> None:
    cluster.kill_worker(worker_id, signal.SIGKILL)


# --------------------------------------------------------------------------- table
@dataclass
class FaultRow:
    case: str
    requests: int
    completed: int
    failed: int
    timed_out: int
    disconnected: int
    hung: int
    leaked_blocks: int
    notes: str = ""


@dataclass
class FaultTable:
    """Collects one row per fault case; ``markdown()`` renders the table."""

    rows: list[FaultRow] = field(default_factory=list)

    def add(
        self, case: str, outcomes: Sequence[Outcome], leaked: dict[str, int], notes: str = ""
    ) -> FaultRow:
        kinds = [o.kind for o in outcomes]
        row = FaultRow(
            case,
            len(outcomes),
            kinds.count("completed"),
            kinds.count("failed"),
            kinds.count("timed_out"),
            kinds.count("disconnected"),
            kinds.count("hung"),
            sum(abs(v) for v in leaked.values()),
            notes,
        )
        self.rows.append(row)
        return row

    def markdown(self) -> str:
        head = (
            "| case | requests | completed | failed with error | router timeout | "
            "client disconnected | hung | leaked blocks | notes |\n"
            "|---|---|---|---|---|---|---|---|---|\n"
        )
        body = "".join(
            f"| {r.case} | {r.requests} | {r.completed} | {r.failed} | {r.timed_out} | "
            f"{r.disconnected} | {r.hung} | {r.leaked_blocks} | {r.notes} |\n"
            for r in self.rows
        )
        return head + body


def summarize_errors(outcomes: Sequence[Outcome]) -> str:
    """``code×n`` over the failed outcomes (for the notes column)."""
    counts: dict[str, int] = {}
    for o in outcomes:
        if o.kind in ("failed", "timed_out"):
            key = o.error_code or (o.error or "?")[:40]
            counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k}×{v}" for k, v in sorted(counts.items()))
