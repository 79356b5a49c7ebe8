"""Cluster time series for ``fluidpd bench replay``: a separate process that subscribes to
``fluidpd.telemetry.>`` and buckets what the workers publish.

It runs in its own process (spawned, not forked) so that decoding ~50 telemetry messages per
worker per second does not load the load generator, whose CPU is measured. Clocks:
``time.monotonic`` is system-wide on Linux, so the parent passes the load generator's start
instant afterwards (``to_trace_time``) and every bucket is stamped with the absolute clock.

Per bucket (``bucket_s`` real seconds) it records: ``prefill_workers`` (workers whose last
telemetry says role prefill), ``prefill_queue`` (sum of their queue lengths), ``decode_running``
(sum of decode workers' running requests) and ``stolen_tokens_total`` (sum over workers of
``decode_stolen_tokens_total``, cumulative). Role changes between two telemetry messages of
one worker are logged as switches.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

from shared.policy.roles import DECODE, PREFILL


def _sampler_main(nats_url: str, bucket_s: float, out_path: str, ready: Any, stop: Any) -> None:
    from services.common.logging import configure_logging

    configure_logging(level=logging.WARNING)  # keep bus chatter off the bench's output
    asyncio.run(_sample(nats_url, bucket_s, Path(out_path), ready, stop))


async def _sample(nats_url: str, bucket_s: float, out_path: Path, ready: Any, stop: Any) -> None:
    from shared.bus import Bus
    from shared.bus.config import BusConfig
    from shared.messages import Subjects, WorkerTelemetry

    latest: dict[str, WorkerTelemetry] = {}
    switches: list[dict[str, Any]] = []
    series: dict[str, list[float]] = {
        "t_s": [],
        "prefill_workers": [],
        "prefill_queue": [],
        "decode_running": [],
        "stolen_tokens_total": [],
    }

    async def on_msg(msg: WorkerTelemetry) -> None:
        prev = latest.get(msg.publisher_id)
        if prev is not None and prev.role != msg.role:
            switches.append(
                {
                    "t_s": time.monotonic(),
                    "worker": msg.publisher_id,
                    "from": prev.role,
                    "to": msg.role,
                }
            )
        latest[msg.publisher_id] = msg

    subjects = Subjects()
    async with Bus(BusConfig.from_url(nats_url), subjects) as bus:
        await bus.subscribe_stream(subjects.telemetry_all(), WorkerTelemetry, on_msg)
        await bus.flush()
        ready.set()
        next_t = time.monotonic() + bucket_s
        while not stop.is_set():
            await asyncio.sleep(max(0.0, next_t - time.monotonic()))  # the sampling clock
            next_t += bucket_s
            rows = list(latest.values())
            series["t_s"].append(time.monotonic())
            series["prefill_workers"].append(sum(1 for r in rows if r.role == PREFILL))
            series["prefill_queue"].append(sum(r.queue_len for r in rows if r.role == PREFILL))
            series["decode_running"].append(sum(r.running for r in rows if r.role == DECODE))
            series["stolen_tokens_total"].append(
                sum(r.metrics.get("decode_stolen_tokens_total", 0.0) for r in rows)
            )
    doc = {"series": series, "switch_log": switches, "workers_seen": sorted(latest)}
    out_path.write_text(json.dumps(doc) + "\n", encoding="utf-8")


class TelemetrySampler:
    """``start(nats_url)`` returns once subscribed; ``stop()`` returns the raw document
    (``{"series", "switch_log"}``, absolute monotonic times; see ``to_trace_time``).

    Not reusable. ``stop`` waits up to ``timeout_s`` for the process to write its file and
    returns empty series if it did not (the run's attainment does not depend on it)."""

    def __init__(self, out_path: Path, bucket_s: float = 0.25) -> None:
        if not bucket_s > 0:
            raise ValueError("bucket_s must be > 0")
        self.out_path = out_path
        self.bucket_s = bucket_s
        ctx = mp.get_context("spawn")
        self._stop = ctx.Event()
        self._ready = ctx.Event()
        self._ctx = ctx
        self._proc: Any = None

    def start(self, nats_url: str, timeout_s: float = 30.0) -> bool:
        """Spawn the sampler; True once it is subscribed (False: it did not get there in
        ``timeout_s``; the run goes on without series)."""
        self._proc = self._ctx.Process(
            target=_sampler_main,
            args=(nats_url, self.bucket_s, str(self.out_path), self._ready, self._stop),
            daemon=True,
        )
        self._proc.start()
        return bool(self._ready.wait(timeout_s))

    def stop(self, timeout_s: float = 10.0) -> dict[str, Any]:
        self._stop.set()
        if self._proc is not None:
            self._proc.join(timeout_s)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(2.0)
        try:
            return dict(json.loads(self.out_path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            return {"series": {}, "switch_log": [], "workers_seen": []}


def to_trace_time(doc: dict[str, Any], t0: float, time_scale: float) -> dict[str, Any]:
    """Series in trace seconds since ``t0`` (the load generator's start, monotonic clock),
    with ``stolen_tokens_per_s`` (per trace second) from the cumulative totals."""
    s = doc.get("series") or {}
    t = [(x - t0) / time_scale for x in s.get("t_s", [])]
    totals = s.get("stolen_tokens_total", [])
    rate = []
    for i, total in enumerate(totals):
        dt = t[i] - t[i - 1] if i else 0.0
        rate.append(round((total - totals[i - 1]) / dt, 1) if i and dt > 0 else 0.0)
    out = {k: v for k, v in s.items() if k not in ("t_s",)}
    out.update(t_s=[round(x, 3) for x in t], stolen_tokens_per_s=rate)
    switches = [
        {**sw, "t_s": round((sw["t_s"] - t0) / time_scale, 3)} for sw in doc.get("switch_log", [])
    ]
    return {"series": out, "switch_log": switches}
