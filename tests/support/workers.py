"""Start real worker processes and talk to them over the bus like a router would."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shared.bus import Bus
from shared.bus.config import BusConfig
from shared.bus.registry import RegistryWatcher
from shared.messages import (
    Ack,
    CancelRequest,
    PrefillRequest,
    SamplingParams,
    StatusReply,
    Subjects,
    TokenBatch,
    WorkerTelemetry,
)

REPO = Path(__file__).resolve().parents[2]


def worker_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        UCX_WARN_UNUSED_ENV_VARS="n",
        UCXPY_PROGRESS_MODE="blocking",
        FLUIDPD_CLUSTER_SECRET="test-secret",
        PYTHONPATH=str(REPO),
    )
    env.update(extra)
    return env


def start_worker(
    role: str, worker_id: str, nats_url: str, *args: str, log_dir: Path | None = None, **env: str
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        f"services.{role}_worker",
        "--id",
        worker_id,
        "--nats",
        nats_url,
        "--heartbeat-s",
        "0.3",
        *args,
    ]
    out = open(log_dir / f"{worker_id}.log", "wb") if log_dir else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(
        cmd, env=worker_env(**env), stdout=out, stderr=subprocess.STDOUT, cwd=REPO
    )


def stop_all(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = 10.0) -> list[int]:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout_s))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    indices: list[int] = field(default_factory=list)


class BusClient:
    """A minimal router stand-in: submits PrefillRequests and gathers streamed tokens."""

    def __init__(self, nats_url: str) -> None:
        self.subjects = Subjects()
        self.router_id = f"t{uuid.uuid4().hex[:8]}"
        self.bus = Bus(BusConfig.from_url(nats_url), self.subjects)
        self.results: dict[str, Result] = {}
        self._done: dict[str, asyncio.Event] = {}
        self.watcher: RegistryWatcher | None = None
        self.telemetry: dict[str, WorkerTelemetry] = {}

    async def __aenter__(self) -> BusClient:
        await self.bus.start()
        await self.bus.subscribe_stream(
            self.subjects.router_tokens(self.router_id), TokenBatch, self._on_batch
        )
        await self.bus.subscribe_stream(
            self.subjects.telemetry_all(), WorkerTelemetry, self._on_telemetry
        )
        self.watcher = RegistryWatcher(self.bus)
        await self.watcher.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.watcher is not None:
            await self.watcher.stop()
        await self.bus.stop()

    async def _on_telemetry(self, msg: WorkerTelemetry) -> None:
        self.telemetry[msg.publisher_id] = msg

    async def _on_batch(self, batch: TokenBatch) -> None:
        for item in batch.items:
            res = self.results.setdefault(item.request_id, Result())
            if res.finish_reason is not None:
                continue
            if item.token_ids:
                res.indices.extend(range(item.index, item.index + len(item.token_ids)))
                res.token_ids.extend(item.token_ids)
            if item.finish_reason is not None:
                res.finish_reason = item.finish_reason
                res.error = item.error
                self._done.setdefault(item.request_id, asyncio.Event()).set()

    async def wait_workers(self, ids: Sequence[str], timeout_s: float = 60.0) -> None:
        assert self.watcher is not None
        want = set(ids)
        await self.watcher.wait_until(
            lambda w: want <= {r.worker_id for r in w.workers(state="active")}, timeout_s
        )

    async def submit(
        self,
        prefill_id: str,
        decode_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        seed: int = 1,
        temperature: float = 0.0,
        steal_ratio: float | None = None,
        ignore_eos: bool = True,
    ) -> str:
        rid = uuid.uuid4().hex[:12]
        self._done[rid] = asyncio.Event()
        now = time.time()
        msg = PrefillRequest(
            request_id=rid,
            router_id=self.router_id,
            prompt_token_ids=tuple(prompt),
            sampling=SamplingParams(
                max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=ignore_eos
            ),
            decode_worker_id=decode_id,
            arrival_time_s=now,
            ttft_deadline_s=now + 2.0,
            tokens_subject=self.subjects.router_tokens(self.router_id),
            force_steal_ratio=steal_ratio,
        )
        await self.bus.request(self.subjects.worker_prefill(prefill_id), msg, Ack, 30.0)
        return rid

    async def result(self, rid: str, timeout_s: float = 60.0) -> Result:
        await asyncio.wait_for(self._done[rid].wait(), timeout_s)
        return self.results[rid]

    async def cancel(self, rid: str, *worker_ids: str) -> None:
        for wid in worker_ids:
            await self.bus.publish(self.subjects.worker_cancel(wid), CancelRequest(request_id=rid))

    async def wait_telemetry(self, predicate, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
        """Wait until ``predicate(self.telemetry)`` holds, re-checking on each telemetry."""
        deadline = time.monotonic() + timeout_s
        while not predicate(self.telemetry):
            if time.monotonic() > deadline:
                raise TimeoutError(f"telemetry condition not met: {self.telemetry}")
            await asyncio.sleep(0.02)  # telemetry arrives every ~20 ms; this is a poll interval

    async def status(self, timeout_s: float = 5.0) -> StatusReply:
        from shared.messages import StatusRequest

        return await self.bus.request(
            self.subjects.controller_status(), StatusRequest(), StatusReply, timeout_s
        )
