"""SLO-aware admission on real processes (emulated engine at 10x its profile's time, real
nats-server, UCX, routers over HTTP): an overloaded router answers 503 + Retry-After with
an OpenAI-style error before any 200, for stream and non-stream; a prefill worker drops
queued requests whose TTFT deadline passed with a clear ``deadline_expired`` error (a 503
when no 200 was sent yet) and every block comes back.

The overload is deterministic: a "hog" prompt whose predicted prefill (T_pre at 10x, ~3 s)
is far beyond the 500 ms TTFT SLO is sent straight to the prefill worker, and the tests wait
until its telemetry shows the queued work before sending anything through a router."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
import pytest_asyncio

from shared.messages import WorkerTelemetry
from tests.support.faults import completion
from tests.support.nats_server import NatsServer
from tests.support.workers import BusClient, start_router, start_worker, stop_all, wait_healthy

pytestmark = pytest.mark.asyncio(loop_scope="module")
ARGS = ("--model", "tiny", "--engine", "emulated", "--time-scale", "10")
ARGS += ("--num-kv-blocks", "1024", "--block-size", "16", "--no-fluidtoken")
HOG_TOKENS = 3000  # T_pre = (3000 x 93.5 us + 15 ms) x 10 = 2.96 s
SHORT = [5 + i % 300 for i in range(8)]  # T_pre ~ 0.16 s: fits a 500 ms SLO when idle


@pytest.fixture(scope="module")
def cluster(
    nats_server_module: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    """pe/de (pe drops queued work as soon as its deadline passed) and two routers with a
    500 ms TTFT SLO: ``shed`` rejects above 1x the SLO, ``open`` never sheds."""
    logs = tmp_path_factory.mktemp("shed-logs")
    url = nats_server_module.url
    procs = [
        start_worker("prefill", "pe", url, *ARGS, "--expire-margin-s", "0", log_dir=logs),
        start_worker("decode", "de", url, *ARGS, log_dir=logs),
    ]
    try:
        urls = {"nats": url}
        for name, multiple in (("shed", "1"), ("open", "0")):
            proc, urls[name] = start_router(
                url,
                "tiny",
                *("--ttft-slo-ms", "500", "--shed-ttft-multiple", multiple),
                log_dir=logs,
                name=f"router-{name}",
            )
            procs.append(proc)
            wait_healthy(urls[name])
        yield urls
    finally:
        assert stop_all(procs) == [0] * len(procs)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(cluster: dict[str, str]) -> AsyncIterator[BusClient]:
    async with BusClient(cluster["nats"]) as c:
        await c.wait_workers(["pe", "de"])
        yield c


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def _idle(t: dict[str, WorkerTelemetry]) -> bool:
    return all(
        (w := t.get(wid)) is not None
        and w.free_blocks == w.total_blocks
        and w.queue_len == 0
        and w.running == 0
        for wid in ("pe", "de")
    )


async def _hog(client: BusClient) -> str:
    """Occupy pe for ~3 s and return once its telemetry shows the work queued ahead (and
    a later message, so every subscriber has had it)."""
    rid = await client.submit("pe", "de", [5 + i % 300 for i in range(HOG_TOKENS)], 2)
    busy = {}

    def seen(t: dict[str, WorkerTelemetry]) -> bool:
        pe = t.get("pe")
        if pe is None or pe.metrics.get("queue_work_s", 0.0) < 1.0:
            return False
        busy.setdefault("seq", pe.seq)
        return pe.seq >= busy["seq"] + 2

    await client.wait_telemetry(seen, 20.0)
    return rid


async def test_an_overloaded_router_answers_503_with_retry_after_before_any_200(
    cluster: dict[str, str], client: BusClient, session: aiohttp.ClientSession
) -> None:
    await client.wait_telemetry(_idle, 30.0)
    idle = await completion(session, cluster["shed"], SHORT, 2, stream=True)
    assert idle.status == 200 and idle.kind == "completed", idle  # not shed when idle
    hog = await _hog(client)
    for stream in (True, False):
        out = await completion(session, cluster["shed"], SHORT, 2, stream=stream)
        assert out.status == 503, out
        assert out.error_code == "overloaded", out
        assert out.retry_after is not None and int(out.retry_after) >= 1, out
    assert (await client.result(hog, timeout_s=30)).finish_reason == "length"
    await client.wait_telemetry(_idle, 30.0)


async def test_deadline_expired_queued_work_is_dropped_and_its_blocks_freed(
    cluster: dict[str, str], client: BusClient, session: aiohttp.ClientSession
) -> None:
    await client.wait_telemetry(_idle, 30.0)
    start = client.telemetry["pe"]
    expired0 = start.metrics["expired_total"]
    hog = await _hog(client)
    # Queued behind the hog through the router that never sheds: their 500 ms deadline
    # passes while the hog runs, so pe drops them when it takes the next prompt.
    streamed, whole = await asyncio.gather(
        completion(session, cluster["open"], SHORT, 2, stream=True),
        completion(session, cluster["open"], SHORT, 2, stream=False),
    )
    # No 200 sent yet: a plain 503 with Retry-After. A stream's 200 and its headers go out at
    # once, so it ends with the same typed error in-band.
    assert (whole.status, whole.error_code) == (503, "deadline_expired"), whole
    assert whole.retry_after is not None, whole
    assert (streamed.status, streamed.error_code) == (200, "deadline_expired"), streamed
    assert streamed.first_token_s is None, streamed  # nothing was computed for it
    assert (await client.result(hog, timeout_s=30)).finish_reason == "length"
    await client.wait_telemetry(
        lambda t: _idle(t) and t["pe"].metrics["expired_total"] == expired0 + 2, 30.0
    )
    assert client.telemetry["pe"].free_blocks == start.free_blocks  # every block back
    assert client.telemetry["de"].free_blocks == client.telemetry["de"].total_blocks
