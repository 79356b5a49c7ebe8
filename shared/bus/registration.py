"""Worker side of the registry: keeps this worker's ``WorkerRecord`` in the bucket while it
lives (heartbeats at a fixed rate, an immediate rewrite on role/state changes, a re-put after a
reconnect, a delete on a clean stop)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import nats.errors
import structlog
from nats.js.kv import KeyValue

from shared.aio import cancel_and_wait
from shared.bus.bus import Bus
from shared.bus.errors import BusError
from shared.bus.registry import RegistryConfig, open_bucket
from shared.messages import WorkerRecord, encode

log = structlog.get_logger("fluidpd.registry")


class WorkerRegistration:
    """Worker side: keeps this worker's record in the bucket while it lives.

    ``start()`` writes the record and starts heartbeats; ``update()`` rewrites it at once
    (role/state changes); ``stop()`` stops heartbeats and deletes the key.
    """

    def __init__(self, bus: Bus, record: WorkerRecord, config: RegistryConfig | None = None):
        self.config = config or RegistryConfig()
        self._bus = bus
        self._record = dataclasses.replace(record, heartbeat_period_s=self.config.heartbeat_s)
        self._kv: KeyValue | None = None
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    @property
    def record(self) -> WorkerRecord:
        return self._record

    async def start(self) -> None:
        """Write the record and start heartbeats. Raises BusError if the first write fails."""
        if not await self._put():
            raise BusError(f"could not register worker {self._record.worker_id}")
        self._bus.add_reconnect_listener(self._on_reconnect)
        self._task = asyncio.create_task(self._heartbeat_loop(), name="registry-heartbeat")

    async def update(self, **changes: Any) -> WorkerRecord:
        """Change fields of the record (e.g. ``role=``, ``state=``) and write it now.

        Returns the new record; a failed write is retried by the next heartbeat.
        """
        self._record = dataclasses.replace(self._record, **changes)
        await self._put()
        return self._record

    async def stop(self, *, deregister: bool = True) -> None:
        """Stop heartbeats; with ``deregister`` also delete the key. Idempotent.

        ``deregister=False`` leaves the record to expire, as after a crash.
        """
        if self._stopped:
            return
        self._stopped = True
        self._bus.remove_reconnect_listener(self._on_reconnect)
        if self._task is not None:
            await cancel_and_wait([self._task])
        if not deregister:
            return
        async with self._lock:  # after any in-flight put, so the delete is the last write
            try:
                kv = self._kv or await open_bucket(self._bus, self.config)
                await kv.delete(self._record.worker_id)
            except (TimeoutError, nats.errors.Error, OSError, BusError) as exc:
                log.warning(
                    "registry.deregister_failed",
                    worker=self._record.worker_id,
                    error=type(exc).__name__,
                )

    async def _on_reconnect(self) -> None:
        if not self._stopped:
            await self._put()

    async def _heartbeat_loop(self) -> None:
        # Fixed rate on the monotonic clock, so put latency does not stretch the period.
        period_s = self.config.heartbeat_s
        next_s = time.monotonic() + period_s
        while not self._stopped:
            await asyncio.sleep(max(0.0, next_s - time.monotonic()))
            await self._put()
            next_s = max(next_s + period_s, time.monotonic())

    async def _put(self) -> bool:
        """Write the current record (stamped now). Returns False on failure (logged)."""
        async with self._lock:
            if self._stopped:
                return False
            self._record = dataclasses.replace(self._record, heartbeat_at_s=time.time())
            try:
                if self._kv is None:
                    self._kv = await open_bucket(self._bus, self.config)
                await self._kv.put(self._record.worker_id, encode(self._record))
                return True
            except (TimeoutError, nats.errors.Error, OSError, BusError) as exc:
                self._kv = None  # re-open (and re-create if the store was lost) next time
                log.warning(
                    "registry.put_failed", worker=self._record.worker_id, error=type(exc).__name__
                )
                return False
