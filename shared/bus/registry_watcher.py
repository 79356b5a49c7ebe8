"""Reader side of the registry (router, controller, workers' peer views): a live, in-memory
view of the registered workers, with local liveness (a worker whose record is not rewritten
for ``DEAD_AFTER_PERIODS`` of its heartbeat periods is dropped) and reconciliation after a
nats-server restart. See :mod:`shared.bus.registry` for the bucket itself."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import structlog
from nats.js.kv import KV_DEL, KV_PURGE

from shared.aio import cancel_and_wait
from shared.bus.bus import Bus
from shared.bus.registry import DEAD_AFTER_PERIODS, RegistryConfig, open_bucket
from shared.messages import MessageError, WorkerRecord, decode
from shared.policy.roles import Role, WorkerState

log = structlog.get_logger("fluidpd.registry")


@dataclass(frozen=True)
class RegistryChange:
    """One change of the watcher's view."""

    kind: Literal["added", "updated", "removed"]
    worker_id: str
    record: WorkerRecord
    reason: str = ""  # for removals: deleted / expired / heartbeat_timeout / resync


@dataclass
class _Entry:
    record: WorkerRecord
    revision: int
    last_seen_s: float  # watcher's monotonic clock


class RegistryWatcher:
    """Router/controller side: a live, in-memory view of registered workers.

    ``changed`` is set on every change (callers clear it); ``on_change`` is called for each.
    """

    def __init__(
        self,
        bus: Bus,
        config: RegistryConfig | None = None,
        on_change: Callable[[RegistryChange], None] | None = None,
    ) -> None:
        self.config = config or RegistryConfig()
        self.changed = asyncio.Event()
        self._bus = bus
        self._on_change = on_change
        self._entries: dict[str, _Entry] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._watch_task: asyncio.Task[None] | None = None
        self._watch_generation = 0
        self._wakeup = asyncio.Event()
        self._ready = asyncio.Event()
        self._stopped = False

    # --- queries ------------------------------------------------------------------------
    def workers(
        self, role: Role | None = None, state: WorkerState | None = None
    ) -> list[WorkerRecord]:
        """Live workers (sorted by id), optionally filtered by role and/or state."""
        return [
            e.record
            for _, e in sorted(self._entries.items())
            if (role is None or e.record.role == role)
            and (state is None or e.record.state == state)
        ]

    def get(self, worker_id: str) -> WorkerRecord | None:
        entry = self._entries.get(worker_id)
        return entry.record if entry else None

    async def wait_until(
        self, predicate: Callable[[RegistryWatcher], bool], timeout_s: float
    ) -> None:
        """Wait until ``predicate(self)`` holds, re-checked on each change.

        Raises TimeoutError.
        """
        async with asyncio.timeout(timeout_s):
            while not predicate(self):
                self.changed.clear()
                if predicate(self):
                    return
                await self.changed.wait()

    # --- lifecycle ----------------------------------------------------------------------
    async def start(self, timeout_s: float = 10.0) -> None:
        """Start watching; returns once the initial snapshot is loaded. Raises TimeoutError."""
        self._bus.add_reconnect_listener(self._on_reconnect)
        self._watch_task = asyncio.create_task(
            self._watch_loop(self._watch_generation), name="registry-watch"
        )
        self._tasks.append(asyncio.create_task(self._reap_loop(), name="registry-reap"))
        async with asyncio.timeout(timeout_s):
            await self._ready.wait()

    async def stop(self) -> None:
        """Stop watching. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._wakeup.set()
        self._bus.remove_reconnect_listener(self._on_reconnect)
        await cancel_and_wait([*self._tasks, *([self._watch_task] if self._watch_task else [])])

    async def _on_reconnect(self) -> None:
        # The server may have restarted: its ephemeral consumers are gone. Watch anew.
        if self._stopped:
            return
        self._watch_generation += 1
        if self._watch_task is not None:
            await cancel_and_wait([self._watch_task])
        self._watch_task = asyncio.create_task(
            self._watch_loop(self._watch_generation), name="registry-watch"
        )

    # --- internals ----------------------------------------------------------------------
    def _emit(self, change: RegistryChange) -> None:
        log.info(
            "registry.change",
            kind=change.kind,
            worker=change.worker_id,
            role=change.record.role,
            state=change.record.state,
            reason=change.reason,
        )
        self.changed.set()
        if self._on_change is not None:
            try:
                self._on_change(change)
            except Exception:  # a listener's bug must not stop the registry
                log.exception("registry.listener_failed")

    def _remove(self, worker_id: str, reason: str) -> None:
        entry = self._entries.pop(worker_id, None)
        if entry is not None:
            self._emit(RegistryChange("removed", worker_id, entry.record, reason))

    def _apply(self, entry: Any, snapshot_keys: set[str] | None) -> None:
        key = entry.key
        if snapshot_keys is not None:
            snapshot_keys.add(key)
        if entry.operation in (KV_DEL, KV_PURGE):
            self._remove(key, "deleted" if entry.operation == KV_DEL else "expired")
            return
        try:
            record = decode(entry.value or b"", WorkerRecord)
        except MessageError as exc:
            log.warning("registry.bad_record", key=key, error=str(exc)[:200])
            return
        if record.worker_id != key:
            log.warning("registry.key_mismatch", key=key)
            return
        old = self._entries.get(key)
        if old is not None and old.revision == entry.revision:
            return  # same write seen again after a re-watch: not a heartbeat
        self._entries[key] = _Entry(record, entry.revision, time.monotonic())
        self._wakeup.set()
        if old is None:
            self._emit(RegistryChange("added", key, record))
        elif dataclasses.replace(old.record, heartbeat_at_s=0.0) != dataclasses.replace(
            record, heartbeat_at_s=0.0
        ):
            self._emit(RegistryChange("updated", key, record))
        # else: a heartbeat only; last_seen_s was refreshed above, nothing to announce

    def _current(self, generation: int) -> bool:
        return not self._stopped and generation == self._watch_generation

    async def _watch_loop(self, generation: int) -> None:
        while self._current(generation):
            watcher = None
            try:
                kv = await open_bucket(self._bus, self.config)
                watcher = await kv.watchall()
                snapshot: set[str] | None = set()
                async for entry in watcher:
                    if not self._current(generation):
                        return
                    if entry is None:  # end of the initial snapshot
                        if snapshot is not None:
                            for key in [k for k in self._entries if k not in snapshot]:
                                self._remove(key, "resync")
                            snapshot = None
                            self._ready.set()
                        continue
                    self._apply(entry, snapshot)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # JetStream unavailable, timeouts during restart, ...
                log.warning("registry.watch_failed", error=type(exc).__name__)
                await asyncio.sleep(self.config.retry_s)
            finally:
                if watcher is not None:
                    # the subscription may be gone with the connection
                    with contextlib.suppress(Exception):
                        await watcher.stop()

    async def _reap_loop(self) -> None:
        while not self._stopped:
            now = time.monotonic()
            deadlines = {
                key: e.last_seen_s + DEAD_AFTER_PERIODS * e.record.heartbeat_period_s
                for key, e in self._entries.items()
            }
            for key, deadline in deadlines.items():
                if deadline <= now:
                    self._remove(key, "heartbeat_timeout")
            upcoming = [d for d in deadlines.values() if d > now]
            timeout = (min(upcoming) - now) if upcoming else None
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout)
