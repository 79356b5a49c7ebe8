"""Which peers a decode worker leaving its role (a D->P switch) may migrate its running
requests to: only Active decode workers of the registry, never one that is itself leaving
(draining, switching) or a prefill worker. The switch takes its peer list from
``Peers.active(DECODE)`` (services/worker/role_switch/switch.py, wired in runtime.py); an
empty list means no migration: the requests finish in place, bounded by the drain deadline.

Real nats-server and registry bucket; the records are written by real registrations."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from typing import cast

import pytest
import pytest_asyncio

from services.worker.peers import Peers
from shared.bus import Bus, BusConfig
from shared.bus.registration import WorkerRegistration
from shared.bus.registry import RegistryConfig
from shared.bus.registry_watcher import RegistryWatcher
from shared.messages import Role, Subjects, WorkerRecord
from shared.policy.roles import ACTIVE, DECODE, DRAIN, PREFILL, SWITCH
from tests.support.worker_messages import worker_record

pytestmark = pytest.mark.asyncio(loop_scope="module")

HEARTBEAT_S = 0.5
CONFIG = RegistryConfig(heartbeat_s=HEARTBEAT_S)


def _record(worker_id: str, role: str) -> WorkerRecord:
    """A live-looking record (this process, now) with the registry's heartbeat period."""
    return worker_record(
        worker_id, cast(Role, role), pid=os.getpid(), started_at_s=time.time(),
        heartbeat_period_s=HEARTBEAT_S, engine="emulated",
    )  # fmt: skip


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(
    nats_server_module,
) -> AsyncIterator[tuple[Peers, RegistryWatcher, dict[str, WorkerRegistration]]]:
    subjects = Subjects(prefix=f"t{os.urandom(3).hex()}")
    config = BusConfig(servers=(nats_server_module.url,))
    async with Bus(config, subjects) as bus:
        regs = {
            w: WorkerRegistration(bus, _record(w, role), CONFIG)
            for w, role in [("d0", DECODE), ("d1", DECODE), ("d2", DECODE), ("p0", PREFILL)]
        }
        for reg in regs.values():
            await reg.start()
        watcher = RegistryWatcher(bus, CONFIG)
        await watcher.start()
        await watcher.wait_until(lambda w: len(w.workers()) == 4, 5.0)
        try:
            yield Peers("d0", bus, subjects, watcher), watcher, regs
        finally:
            await watcher.stop()
            for reg in regs.values():
                await reg.stop()


def _seen(worker_id: str, state: str, role: str = DECODE):
    return lambda w: (r := w.get(worker_id)) is not None and (r.role, r.state) == (role, state)


async def test_only_active_decode_workers_are_migration_peers(
    cluster: tuple[Peers, RegistryWatcher, dict[str, WorkerRegistration]],
) -> None:
    peers, watcher, regs = cluster
    assert [r.worker_id for r in peers.active(DECODE)] == ["d1", "d2"]  # never itself

    # d0 and d1 both leave decode at once: d0 may move its requests to d2 only.
    await regs["d0"].update(state=DRAIN)
    await regs["d1"].update(state=DRAIN)
    await watcher.wait_until(_seen("d1", DRAIN), 5.0)
    assert [r.worker_id for r in peers.active(DECODE)] == ["d2"]

    await regs["d1"].update(state=SWITCH)  # past its drain, not yet a prefill worker
    await watcher.wait_until(_seen("d1", SWITCH), 5.0)
    assert [r.worker_id for r in peers.active(DECODE)] == ["d2"]

    # The last Active decode peer leaves too: no peer (the switch waits for its requests
    # to finish in place instead), and an Active prefill worker is never one.
    await regs["d2"].update(state=DRAIN)
    await watcher.wait_until(_seen("d2", DRAIN), 5.0)
    assert peers.active(DECODE) == []
    assert [r.worker_id for r in peers.active(PREFILL)] == ["p0"]

    # d1 finished its switch (Active prefill): still no decode peer; d2 came back: a peer.
    await regs["d1"].update(role=PREFILL, state=ACTIVE)
    await regs["d2"].update(state=ACTIVE)
    await watcher.wait_until(_seen("d2", ACTIVE), 5.0)
    await watcher.wait_until(_seen("d1", ACTIVE, PREFILL), 5.0)
    assert [r.worker_id for r in peers.active(DECODE)] == ["d2"]
