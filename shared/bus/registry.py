"""Worker registry: a JetStream KV bucket of WorkerRecords with a TTL, plus local liveness.

This module owns the bucket (its name, TTL, creation) and the shared ``RegistryConfig``;
the worker side is :mod:`shared.bus.registration`, the reader side
:mod:`shared.bus.registry_watcher`.

* The bucket (``Subjects.registry_bucket()``, e.g. ``fluidpd_registry``) has
  ``max_age = 3 × heartbeat_s``: a worker that stops writing vanishes from the server, and
  (nats-server >= 2.11, ``limit_marker_ttl``) the expiry is delivered to watchers as a
  purge marker.
* Server-side expiry is not prompt enough to rely on (the server checks ages on its own
  timer), so ``RegistryWatcher`` also drops a worker whose record it has not seen
  rewritten for ``DEAD_AFTER_PERIODS`` (2.5) of that worker's heartbeat periods, measured
  on the watcher's monotonic clock (no cross-host clock comparison). A dead worker thus
  leaves every watcher's view within 3 heartbeat periods.
* Both sides survive a nats-server restart: on reconnect the worker re-puts its record
  (re-creating the bucket if the store was lost) and the watcher re-creates its watch and
  reconciles (keys missing from the new snapshot are dropped; records whose revision did
  not change keep their old last-seen time, so reconnects never extend a dead worker).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import nats.js.errors
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from shared.bus.bus import Bus

DEAD_AFTER_PERIODS = 2.5
BUCKET_TTL_PERIODS = 3.0


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
