"""A live migration whose KV send fails after the hand-over: real nats-server, router,
controller and 1P3D emulated worker processes (model tiny, real UCX). The fault is
injected into d0's migration sends (tests/support/migration_fault): the envelope goes out,
then the send fails with a retryable error and the sender aborts, so the peer's receive
fails too, after d0 already told the router (hand-over item) that the peer decodes the
request.

The source owns the outcome of such a move; the peer that failed to receive it must end
it silently (an error item from it, in the request's custody, would end a stream that goes
on elsewhere). Shown, through the router's HTTP API:

* every peer fails (``*``): d0's switch is rolled back, its requests resume there and
  every stream completes with all its tokens;
* only d1 fails: the request that tried d1 first moves on to d2, the switch completes,
  every stream completes with all its tokens;
* the peers counted the failed receives (so the fault did reach them), the router counted
  no foreign item, and no worker holds a block afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from services.common.cluster import Cluster
from tests.support.faults import Outcome, completion, fault_cluster, leaked_blocks, prompt
from tests.support.workers import REPO, BusClient

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

FAULT_SITE = REPO / "tests" / "support" / "migration_fault"
WORKERS = ["p0", "d0", "d1", "d2"]
N_STREAMS, OUT_TOKENS = 6, 400  # 2 per decode worker (round robin), long enough to move


@pytest.fixture(scope="module")
def fault_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("migration-faults")


@pytest.fixture(scope="module")
def cluster(fault_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    env = (
        ("PYTHONPATH", f"{FAULT_SITE}:{REPO}"),
        ("FLUIDPD_TEST_MIGRATION_FAULT_DIR", str(fault_dir)),
    )
    logs = tmp_path_factory.mktemp("fail-migration-logs")
    router_args = ("--request-timeout-s", "90", "--pairing", "round_robin")
    with fault_cluster(logs, prefill=1, decode=3, env=env, router_args=router_args) as c:
        yield c


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(cluster: Cluster) -> AsyncIterator[BusClient]:
    async with BusClient(cluster.operator_url) as c:
        await c.wait_workers(WORKERS)
        await c.wait_telemetry(lambda t: all(w in t for w in WORKERS), 10)
        yield c


def _metric(client: BusClient, worker_id: str, name: str) -> float:
    return client.telemetry[worker_id].metrics.get(name, 0.0)


def _state_events(client: BusClient, worker_id: str) -> list[tuple[str, str, str]]:
    return [
        (e.event.role, e.event.to_state, e.event.reason)
        for e in client.events
        if e.event.publisher_id == worker_id
    ]


async def _streams_while_d0_switches(
    client: BusClient, session: aiohttp.ClientSession, url: str, first_prompt: int
) -> list[asyncio.Task[Outcome]]:
    """Start the streams, wait until d0 runs two of them, ask d0 to switch to prefill."""
    streams = [
        asyncio.ensure_future(
            completion(session, url, prompt(first_prompt + i, 64), OUT_TOKENS, deadline_s=90)
        )
        for i in range(N_STREAMS)
    ]
    await client.wait_telemetry(lambda t: "d0" in t and t["d0"].running >= 2, 30)
    assert (await client.switch("d0", "prefill")).ok
    return streams


async def test_failed_sends_to_every_peer_resume_the_requests_on_the_source(
    client: BusClient, cluster: Cluster, fault_dir: Path
) -> None:
    (fault_dir / "d0").write_text("*")
    failed_before = sum(_metric(client, w, "migrations_in_failed_total") for w in ("d1", "d2"))
    before = len(_state_events(client, "d0"))
    async with aiohttp.ClientSession() as session:
        streams = await _streams_while_d0_switches(client, session, cluster.router_url, 0)
        await client.wait_until(
            lambda: (
                ("decode", "active", "switch cancelled: a migration failed")
                in _state_events(client, "d0")[before:]
            ),
            20,
        )
        outcomes = await asyncio.gather(*streams)
    assert [o.kind for o in outcomes] == ["completed"] * N_STREAMS, outcomes
    assert {o.tokens for o in outcomes} == {OUT_TOKENS}
    # The peers' receives did fail (after the hand-over): the case under test happened.
    await client.wait_telemetry(
        lambda t: (
            sum(t[w].metrics.get("migrations_in_failed_total", 0.0) for w in ("d1", "d2"))
            >= failed_before + 2
        ),
        10,
    )
    assert await leaked_blocks(client, WORKERS) == {}


async def test_a_failed_send_moves_the_request_on_to_the_next_peer(
    client: BusClient, cluster: Cluster, fault_dir: Path
) -> None:
    (fault_dir / "d0").write_text("d1")
    failed_before = _metric(client, "d1", "migrations_in_failed_total")
    moved_before = _metric(client, "d2", "migrations_in_total")
    assert client.watcher is not None
    async with aiohttp.ClientSession() as session:
        streams = await _streams_while_d0_switches(client, session, cluster.router_url, 100)
        await client.watcher.wait_until(
            lambda w: (r := w.get("d0")) is not None and (r.role, r.state) == ("prefill", "active"),
            20,
        )
        outcomes = await asyncio.gather(*streams)
    assert [o.kind for o in outcomes] == ["completed"] * N_STREAMS, outcomes
    assert {o.tokens for o in outcomes} == {OUT_TOKENS}
    # d0 moved at least two requests, each to d2; one of them tried d1 first (the peer
    # order rotates per request) and d1's receive failed.
    await client.wait_telemetry(
        lambda t: (
            t["d1"].metrics.get("migrations_in_failed_total", 0.0) >= failed_before + 1
            and t["d2"].metrics.get("migrations_in_total", 0.0) >= moved_before + 2
        ),
        10,
    )
    async with (
        aiohttp.ClientSession() as session,
        session.get(cluster.router_url + "/metrics") as resp,
    ):
        metrics = await resp.text()
    assert "fluidpd_router_foreign_token_items_total 0.0" in metrics.splitlines()
    assert await leaked_blocks(client, WORKERS) == {}
