"""Worker registry on a real nats-server with JetStream: registration, heartbeats, watcher
liveness (a dead worker leaves within 3 heartbeat periods) and recovery after a restart."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from shared.bus import Bus, BusConfig
from shared.bus.registration import WorkerRegistration
from shared.bus.registry import RegistryConfig, open_bucket
from shared.bus.registry_watcher import RegistryChange, RegistryWatcher
from shared.messages import Subjects, WorkerRecord

HEARTBEAT_S = 0.2
CONFIG = RegistryConfig(heartbeat_s=HEARTBEAT_S)


def make_record(worker_id: str, role: str = "prefill") -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        role=role,
        state="active",
        pid=os.getpid(),
        host="localhost",
        ucx_address=b"\x01\x02",
        model="tiny",
        fingerprint="fp1",
        kv_total_blocks=64,
        kv_block_size=16,
        max_model_len=2048,
        started_at_s=time.time(),
        heartbeat_at_s=0.0,
        heartbeat_period_s=HEARTBEAT_S,
        engine="emulated",
    )


def present(worker_id: str, state: str | None = None):
    def check(watcher: RegistryWatcher) -> bool:
        record = watcher.get(worker_id)
        return record is not None and (state is None or record.state == state)

    return check


def absent(worker_id: str):
    return lambda watcher: watcher.get(worker_id) is None


@pytest.fixture
async def buses(nats_server_module):
    # Each test gets its own prefix, so buckets (and watchers' views) never mix.
    subjects = Subjects(prefix=f"t{os.urandom(3).hex()}")
    config = BusConfig(servers=(nats_server_module.url,))
    async with Bus(config, subjects) as worker_bus, Bus(config, subjects) as watcher_bus:
        yield worker_bus, watcher_bus


async def test_register_update_deregister(buses):
    worker_bus, watcher_bus = buses
    changes: list[RegistryChange] = []
    watcher = RegistryWatcher(watcher_bus, CONFIG, on_change=changes.append)
    await watcher.start()
    assert watcher.workers() == []
    prefill = WorkerRegistration(worker_bus, make_record("p0"), CONFIG)
    decode = WorkerRegistration(worker_bus, make_record("d0", role="decode"), CONFIG)
    await prefill.start()
    await decode.start()
    await watcher.wait_until(lambda w: len(w.workers()) == 2, 2.0)
    assert [r.worker_id for r in watcher.workers(role="decode")] == ["d0"]
    seen = watcher.get("p0")
    assert seen is not None and seen.ucx_address == b"\x01\x02" and seen.fingerprint == "fp1"
    assert seen.heartbeat_period_s == HEARTBEAT_S and seen.heartbeat_at_s > 0

    await prefill.update(role="decode", state="switching")
    await watcher.wait_until(present("p0", "switching"), 2.0)
    assert [r.worker_id for r in watcher.workers(role="decode", state="switching")] == ["p0"]

    await prefill.stop()
    await watcher.wait_until(absent("p0"), 2.0)
    await prefill.stop()  # idempotent
    kinds = [(c.kind, c.worker_id, c.reason) for c in changes]
    assert kinds == [
        ("added", "p0", ""),
        ("added", "d0", ""),
        ("updated", "p0", ""),
        ("removed", "p0", "deleted"),
    ]
    # the bucket carries the TTL that makes the server forget silent workers too
    kv = await open_bucket(worker_bus, CONFIG)
    assert (await kv.status()).ttl == pytest.approx(3 * HEARTBEAT_S)
    await decode.stop()
    await watcher.stop()


async def test_dead_worker_drops_out_within_three_heartbeat_periods(buses):
    worker_bus, watcher_bus = buses
    changes: list[RegistryChange] = []
    watcher = RegistryWatcher(watcher_bus, CONFIG, on_change=changes.append)
    await watcher.start()
    doomed = WorkerRegistration(worker_bus, make_record("p1"), CONFIG)
    alive = WorkerRegistration(worker_bus, make_record("d1", role="decode"), CONFIG)
    await doomed.start()
    await alive.start()
    await watcher.wait_until(lambda w: len(w.workers()) == 2, 2.0)
    # Heartbeating workers stay: watch for 5 periods and expect no removal.
    await asyncio.sleep(5 * HEARTBEAT_S)
    assert [c.kind for c in changes] == ["added", "added"]

    await doomed.stop(deregister=False)  # a crash: heartbeats stop, the key stays
    crashed_at = time.monotonic()
    await watcher.wait_until(absent("p1"), 10 * HEARTBEAT_S)
    elapsed_s = time.monotonic() - crashed_at
    assert elapsed_s <= 3 * HEARTBEAT_S, elapsed_s
    assert changes[-1].kind == "removed" and changes[-1].reason == "heartbeat_timeout"
    assert present("d1")(watcher)

    # A watcher started after the crash sees the stale record at most until it expires.
    late = RegistryWatcher(watcher_bus, CONFIG)
    started_at = time.monotonic()
    await late.start()
    await late.wait_until(absent("p1"), 10 * HEARTBEAT_S)
    assert time.monotonic() - started_at <= 3 * HEARTBEAT_S
    assert present("d1")(late)
    await alive.stop()
    await late.stop()
    await watcher.stop()


async def test_registration_and_watcher_survive_server_restart(nats_server):
    subjects = Subjects()
    config = BusConfig(servers=(nats_server.url,), reconnect_wait_s=0.05)
    async with Bus(config, subjects) as worker_bus, Bus(config, subjects) as watcher_bus:
        changes: list[RegistryChange] = []
        watcher = RegistryWatcher(watcher_bus, CONFIG, on_change=changes.append)
        await watcher.start()
        worker = WorkerRegistration(worker_bus, make_record("p0"), CONFIG)
        await worker.start()
        await watcher.wait_until(present("p0"), 2.0)

        await asyncio.to_thread(nats_server.restart)  # same port, same JetStream store

        # Changes made after the restart reach the watcher (re-put + re-watch)...
        await worker.update(state="draining")
        await watcher.wait_until(present("p0", "draining"), 5.0)
        newcomer = WorkerRegistration(worker_bus, make_record("d9", role="decode"), CONFIG)
        await newcomer.start()
        await watcher.wait_until(present("d9"), 5.0)
        # ...heartbeats keep both alive...
        removals_before = sum(c.kind == "removed" for c in changes)
        await asyncio.sleep(5 * HEARTBEAT_S)
        assert sum(c.kind == "removed" for c in changes) == removals_before
        assert [r.worker_id for r in watcher.workers()] == ["d9", "p0"]
        # ...and a crash after the restart is still detected.
        await newcomer.stop(deregister=False)
        await watcher.wait_until(absent("d9"), 10 * HEARTBEAT_S)
        await worker.stop()
        await watcher.wait_until(absent("p0"), 2.0)
        await watcher.stop()


def test_registry_config_validation():
    with pytest.raises(ValueError):
        RegistryConfig(heartbeat_s=0)
    assert RegistryConfig(heartbeat_s=2.0).bucket_ttl_s == 6.0
