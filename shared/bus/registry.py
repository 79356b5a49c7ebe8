"""Worker registry: a JetStream KV bucket of WorkerRecords with a TTL, plus local liveness.

* The bucket (``Subjects.registry_bucket()``, e.g. ``fluidpd_registry``) has
  ``max_age = 3 × heartbeat_s``: a worker that stops writing vanishes from the server, and
  (nats-server >= 2.11, ``limit_marker_ttl``) the expiry is delivered to watchers as a
  purge marker.
* Server-side expiry is not prompt enough to rely on (the server checks ages on its own
  timer), so :class:`RegistryWatcher` also drops a worker whose record it has not seen
  rewritten for ``DEAD_AFTER_PERIODS`` (2.5) of that worker's heartbeat periods, measured
  on the watcher's monotonic clock (no cross-host clock comparison). A dead worker thus
  leaves every watcher's view within 3 heartbeat periods.
* Both sides survive a nats-server restart: on reconnect the worker re-puts its record
  (re-creating the bucket if the store was lost) and the watcher re-creates its watch and
  reconciles (keys missing from the new snapshot are dropped; records whose revision did
  not change keep their old last-seen time, so reconnects never extend a dead worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import nats.errors
import nats.js.errors
import structlog
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from shared.bus.bus import Bus
from shared.bus.errors import BusError
from shared.messages import MessageError, WorkerRecord, decode, encode
from shared.policy.roles import Role, WorkerState

DEAD_AFTER_PERIODS = 2.5
BUCKET_TTL_PERIODS = 3.0

log = structlog.get_logger("fluidpd.registry")


async def cancel_and_wait(tasks: list[asyncio.Task[None]], timeout_s: float = 5.0) -> None:
    """Cancel ``tasks`` and wait for them to end, cancelling again while they run.

    Python 3.11's asyncio.wait_for (used inside nats-py) can swallow a cancellation when
    the awaited future completes at the same moment; a single cancel() is then lost.
    """
    deadline = time.monotonic() + timeout_s
    pending = {t for t in tasks if not t.done()}
    while pending and time.monotonic() < deadline:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.05)
    if pending:
        log.warning("registry.tasks_not_stopped", count=len(pending))


@dataclass(frozen=True)
class RegistryConfig:
    """Heartbeat period shared by workers and watchers (watchers use each record's own)."""

    heartbeat_s: float = 1.0
    retry_s: float = 0.25  # back-off while JetStream is unavailable (e.g. right after restart)

    def __post_init__(self) -> None:
        if self.heartbeat_s <= 0 or self.retry_s <= 0:
            raise ValueError("heartbeat_s and retry_s must be > 0")

    @property
    def bucket_ttl_s(self) -> float:
        return BUCKET_TTL_PERIODS * self.heartbeat_s

    @property
    def op_timeout_s(self) -> float:
        return min(5.0, max(0.5, self.heartbeat_s))


async def open_bucket(bus: Bus, config: RegistryConfig) -> KeyValue:
    """Open the registry bucket, creating it if missing (race-safe). Raises nats errors.

    Operations on the returned bucket time out after ``config.op_timeout_s``: a heartbeat
    write that takes longer than about a period is worthless, and the next one retries.
    """
    js = bus.jetstream(timeout_s=config.op_timeout_s)
    name = bus.subjects.registry_bucket()
    try:
        return await js.key_value(name)
    except nats.js.errors.BucketNotFoundError:
        pass
    kv_config = KeyValueConfig(
        bucket=name,
        history=1,
        ttl=config.bucket_ttl_s,
        storage=StorageType.FILE,
        limit_marker_ttl=max(1.0, config.bucket_ttl_s),
    )
    try:
        return await js.create_key_value(kv_config)
    except nats.js.errors.KeyValueLimitMarkerTTLNotSupportedError:
        return await js.create_key_value(dataclasses.replace(kv_config, limit_marker_ttl=None))
    except nats.js.errors.BadRequestError:  # created concurrently by someone else
        return await js.key_value(name)


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
