"""Switch failures (issue 17): real nats-server, controller, router and worker processes
(emulated engine, model tiny, real UCX transfers).

* A D->P switch whose live migration is rejected (the only decode peer seals its tickets
  with another cluster secret, as during a secret rotation): the worker rolls back to
  Active(decode) with admission on, its requests resume there and complete, the peer's
  reservation is freed, and a later switch is accepted.
* Two concurrent switch commands for the last two prefill workers: the controller's switch
  lease refuses one (services/controller/leases.py), and the last prefill worker may not
  leave.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from services.common.cluster import Cluster
from tests.support.faults import FAULT_WORKER_ARGS, fault_cluster, leaked_blocks, prompt
from tests.support.workers import BusClient, start_worker, stop_all

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(150)]


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fail-switch-logs")


@pytest.fixture(scope="module")
def cluster(logs: Path) -> Iterator[Cluster]:
    with fault_cluster(logs, prefill=2, decode=1) as c:
        yield c


@pytest.fixture(scope="module")
def rotated(cluster: Cluster, logs: Path) -> Iterator[subprocess.Popen[bytes]]:
    """d1: a decode worker whose cluster secret differs from everyone else's."""
    args = ("--engine", "emulated", "--model", "tiny", *FAULT_WORKER_ARGS)
    proc = start_worker(
        "decode",
        "d1",
        cluster.nats_url,
        *args,
        "--num-kv-blocks",
        "2048",
        log_dir=logs,
        FLUIDPD_CLUSTER_SECRET="a-rotated-secret",
        **cluster.worker_env("d1"),
    )
    try:
        yield proc
    finally:
        stop_all([proc])


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(cluster: Cluster, rotated: subprocess.Popen[bytes]) -> AsyncIterator[BusClient]:
    async with BusClient(cluster.operator_url) as c:
        await c.wait_workers(["p0", "p1", "d0", "d1"])
        yield c


def _state_events(client: BusClient, worker_id: str) -> list[tuple[str, str, str]]:
    return [
        (e.event.role, e.event.to_state, e.event.reason)
        for e in client.events
        if e.event.publisher_id == worker_id
    ]


async def test_rejected_migration_rolls_the_switch_back(client: BusClient) -> None:
    rids = [await client.submit("p0", "d0", prompt(i, 200), 300) for i in range(2)]
    await client.wait_telemetry(lambda t: "d0" in t and t["d0"].running == 2, 20)
    before = len(_state_events(client, "d0"))
    reply = await client.switch("d0", "prefill")
    assert reply.ok, reply
    # Back to Active(decode) at once (not after the 60 s drain deadline), admission on.
    await client.wait_until(
        lambda: (
            ("decode", "active", "switch cancelled: a migration failed")
            in _state_events(client, "d0")[before:]
        ),
        10,
    )
    assert client.watcher is not None
    # The record is written before the event is published, but the registry watch (a
    # JetStream KV consumer) may deliver it after the event: wait for it to arrive.
    await client.watcher.wait_until(
        lambda w: (r := w.get("d0")) is not None and r.state != "drain", 10
    )
    record = client.watcher.get("d0")
    assert record is not None and (record.role, record.state) == ("decode", "active")
    # The frozen requests resumed on d0 and complete with every token, from d0 only.
    for rid in rids:
        st = await client.result(rid, 60)
        assert st.error is None and st.finish_reason == "length", st
        assert st.indices == list(range(300)), st.indices[:5]
        assert set(st.publishers) <= {"p0", "d0"}, set(st.publishers)
    # d1 reserved blocks for a ticket that was never used: freed (the cancel), nothing
    # else leaked anywhere.
    assert await leaked_blocks(client, ["p0", "p1", "d0", "d1"]) == {}
    # A later switch is accepted and completes (no request left to migrate), and back.
    assert (await client.switch("d0", "prefill")).ok
    await client.watcher.wait_until(
        lambda w: (r := w.get("d0")) is not None and (r.role, r.state) == ("prefill", "active"),
        20,
    )
    assert (await client.switch("d0", "decode")).ok
    await client.watcher.wait_until(
        lambda w: (r := w.get("d0")) is not None and (r.role, r.state) == ("decode", "active"),
        20,
    )
    # And d0 still serves decode work.
    rid = await client.submit("p1", "d0", prompt(7, 100), 20)
    st = await client.result(rid, 60)
    assert st.error is None and len(st.indices) == 20, st


async def test_concurrent_switches_cannot_empty_a_role(client: BusClient) -> None:
    # p0 and p1 are the last two prefill workers; each one's local registry view sees the
    # other Active, so only the controller's lease can refuse one of the two.
    replies = await asyncio.gather(client.switch("p0", "decode"), client.switch("p1", "decode"))
    assert sorted(r.ok for r in replies) == [False, True], replies
    refused = next(r for r in replies if not r.ok)
    assert refused.error and "prefill" in refused.error, refused
    moved = "p0" if replies[0].ok else "p1"
    stayed = "p1" if moved == "p0" else "p0"
    assert client.watcher is not None
    await client.watcher.wait_until(
        lambda w: (r := w.get(moved)) is not None and (r.role, r.state) == ("decode", "active"),
        20,
    )
    record = client.watcher.get(stayed)
    assert record is not None and (record.role, record.state) == ("prefill", "active")
    # The last prefill worker may not leave; once the other is back, it may.
    last = await client.switch(stayed, "decode")
    assert not last.ok and "no active prefill" in (last.error or ""), last
    assert (await client.switch(moved, "prefill")).ok
    await client.watcher.wait_until(
        lambda w: (r := w.get(moved)) is not None and (r.role, r.state) == ("prefill", "active"),
        20,
    )
    # Served end to end afterwards, nothing leaked.
    rid = await client.submit(moved, "d0", prompt(11, 100), 10)
    st = await client.result(rid, 60)
    assert st.error is None and len(st.indices) == 10, st
    assert await leaked_blocks(client, ["p0", "p1", "d0", "d1"]) == {}
