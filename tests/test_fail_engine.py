"""A decode worker whose engine step raises (issue 17): real nats-server, router,
controller and worker processes (emulated engine, model tiny); the fault is injected into
``EmulatedEngine.step`` of one decode worker process (tests/support/engine_fault).

Also: out-of-vocabulary ids sent straight over NATS are refused by the worker (a
per-request error) and never reach the engine.

Shown: the requests it held fail within seconds with ``engine_failed``; it leaves the
serving set (registry state ``failed``, then gone from ``fluidpd ctl status``) and exits
with status 3; its pool is whole and consistent before it exits; nothing leaks on the
other workers; new requests are served by the other decode worker.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from services.common.cluster import Cluster
from services.worker.failure import EXIT_ENGINE_FAILED
from shared.bus import RemoteError
from tests.support.faults import (
    TINY_VOCAB,
    completion,
    fault_cluster,
    leaked_blocks,
    prompt,
    serves_new_requests,
    wait_ctl_status,
)
from tests.support.workers import REPO, BusClient

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(150)]

FAULT_SITE = REPO / "tests" / "support" / "engine_fault"


@pytest.fixture(scope="module")
def fault_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-faults")


@pytest.fixture(scope="module")
def cluster(fault_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    env = (
        ("PYTHONPATH", f"{FAULT_SITE}:{REPO}"),
        ("FLUIDPD_TEST_ENGINE_FAULT_DIR", str(fault_dir)),
    )
    logs = tmp_path_factory.mktemp("fail-engine-logs")
    # A long router timeout: on a loaded 2-core VM the surviving streams may take a while.
    router_args = ("--request-timeout-s", "60", "--pairing", "round_robin")
    with fault_cluster(logs, prefill=1, decode=2, env=env, router_args=router_args) as c:
        yield c


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(cluster: Cluster) -> AsyncIterator[BusClient]:
    async with BusClient(cluster.operator_url) as c:
        await c.wait_workers(["p0", "d0", "d1"])
        yield c


async def test_out_of_vocabulary_ids_are_refused_before_the_engine(client: BusClient) -> None:
    # Straight over NATS (the router would refuse them): to a prefill worker, and to a
    # decode worker serving a prompt whole. A per-request error, so the worker stays.
    bad = [*prompt(3, 20), TINY_VOCAB + 5]
    for prefill_id, decode_id in (("p0", "d0"), ("d1", "d1")):
        with pytest.raises(RemoteError) as info:
            await client.submit(prefill_id, decode_id, bad, 4)
        assert info.value.code == "invalid_request_error", info.value
        assert "out of the vocabulary" in info.value.remote_message
    assert client.watcher is not None
    assert {r.worker_id for r in client.watcher.workers(state="active")} == {"p0", "d0", "d1"}
    rid = await client.submit("p0", "d0", prompt(4, 20), 4)
    st = await client.result(rid, 30)
    assert st.error is None and len(st.indices) == 4, st


async def test_engine_step_raising_fails_requests_and_takes_the_worker_out(
    cluster: Cluster, client: BusClient, fault_dir: Path
) -> None:
    # Round-robin pairing alternates d0/d1. 300 output tokens take ~5 s at this profile's
    # decode speed; d0's requests must end with engine_failed within seconds of the fault.
    async with aiohttp.ClientSession() as s:
        started = time.monotonic()
        futs = [
            asyncio.ensure_future(
                completion(s, cluster.router_url, prompt(i, 300), 300, deadline_s=60)
            )
            for i in range(4)
        ]
        await client.wait_telemetry(
            lambda t: "d0" in t and t["d0"].running >= 1 and "d1" in t and t["d1"].running >= 1,
            20,
        )
        (fault_dir / "d0").touch()
        fault_at = time.monotonic()
        # d0 leaves the serving set: state "failed" in the registry, then gone.
        assert client.watcher is not None
        await client.watcher.wait_until(
            lambda w: (r := w.get("d0")) is None or r.state == "failed", 10
        )
        # Before it exits, its own telemetry shows the whole pool free.
        await client.wait_telemetry(
            lambda t: t["d0"].state == "failed" and t["d0"].free_blocks == t["d0"].total_blocks,
            10,
        )
        outcomes = await asyncio.gather(*futs)
    failed = [o for o in outcomes if o.kind == "failed"]
    assert failed and all(o.error_code == "engine_failed" for o in failed), outcomes
    for o in failed:
        assert o.ended_s is not None and started + o.ended_s - fault_at < 5.0, o
    assert [o.kind for o in outcomes].count("completed") == len(outcomes) - len(failed), outcomes
    # The process exits with the engine-failure status (a supervisor restarts it).
    assert await asyncio.to_thread(cluster.workers["d0"].wait, 20) == EXIT_ENGINE_FAILED
    log_lines = (Path(cluster.spec.log_dir or ".") / "d0.log").read_text().splitlines()
    assert any("worker_failed" in line and "integrity=ok" in line for line in log_lines), "\n".join(
        log_lines[-20:]
    )
    await wait_ctl_status(cluster.operator_url, {"p0", "d1"})
    assert await leaked_blocks(client, ["p0", "d1"]) == {}
    new = await serves_new_requests(cluster.router_url, 3)
    assert [o.kind for o in new] == ["completed"] * 3, new
    assert json.dumps([r.worker_id for r in client.watcher.workers(role="decode")]) == '["d1"]'
