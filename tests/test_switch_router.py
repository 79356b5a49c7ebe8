"""Live migrations seen through the real router (custody by hand-over only): real
nats-server, router, controller and 1P3D emulated worker processes (model tiny, real UCX).
Streams run through the router's HTTP API while d0 and then d1 switch to prefill, so d0's
requests move to d1 and d2 and d1 passes its own (those it got from d0 too) on to d2: a
request can change decode worker twice. Each move is announced by the worker that had it
(a hand-over item) before the KV leaves; the router takes no token from anyone else.

Shown: every stream completes with all its tokens; at least one request moved twice
(d1 migrated in and out); the router counted no foreign token item."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from services.common.cluster import Cluster
from tests.support.faults import completion, fault_cluster, prompt
from tests.support.workers import BusClient

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(150)]

N_STREAMS, OUT_TOKENS = 12, 400  # 4 per decode worker (round robin), long enough to move


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs: Path = tmp_path_factory.mktemp("switch-router-logs")
    router_args = ("--request-timeout-s", "90", "--pairing", "round_robin")
    with fault_cluster(logs, prefill=1, decode=3, router_args=router_args) as c:
        yield c


async def _active_as(client: BusClient, worker_id: str, role: str) -> None:
    assert client.watcher is not None
    await client.watcher.wait_until(
        lambda w: (r := w.get(worker_id)) is not None and (r.role, r.state) == (role, "active"),
        20,
    )


async def test_migrated_streams_reach_the_client_through_the_router(cluster: Cluster) -> None:
    async with BusClient(cluster.operator_url) as client, aiohttp.ClientSession() as session:
        await client.wait_workers(["p0", "d0", "d1", "d2"])
        streams = [
            asyncio.ensure_future(
                completion(session, cluster.router_url, prompt(i, 64), OUT_TOKENS, deadline_s=90)
            )
            for i in range(N_STREAMS)
        ]
        await client.wait_telemetry(
            lambda t: all(w in t and t[w].running >= 2 for w in ("d0", "d1")), 30
        )
        assert (await client.switch("d0", "prefill")).ok
        await _active_as(client, "d0", "prefill")
        # One of d0's requests is installed on d1 (runnable there, so d1's switch moves it).
        await client.wait_telemetry(
            lambda t: t["d1"].metrics.get("migrations_in_total", 0.0) >= 1.0, 10
        )
        assert (await client.switch("d1", "prefill")).ok
        await _active_as(client, "d1", "prefill")
        outcomes = await asyncio.gather(*streams)
        assert [o.kind for o in outcomes] == ["completed"] * N_STREAMS, outcomes
        assert {o.tokens for o in outcomes} == {OUT_TOKENS}
        # d1 took at least one of d0's requests and moved it on (0 before either switch).
        await client.wait_telemetry(lambda t: t["d1"].metrics.get("switches_total", 0.0) >= 1.0, 10)
        d1 = client.telemetry["d1"].metrics
        assert d1["migrations_in_total"] >= 1 and d1["migrations_out_total"] >= 1, d1
        async with session.get(cluster.router_url + "/metrics") as resp:
            metrics = await resp.text()
        assert "fluidpd_router_foreign_token_items_total 0.0" in metrics.splitlines()
