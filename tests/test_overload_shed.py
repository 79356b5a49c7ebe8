"""SLO-aware admission on real processes (emulated engine at 10x its profile's time, real
nats-server, UCX, routers over HTTP): an overloaded router answers 503 + Retry-After with
an OpenAI-style error before any 200, for stream and non-stream; a prefill worker drops
queued requests whose TTFT deadline passed with a 503 ``deadline_expired`` + Retry-After
(stream or not: a stream's 200 waits for its first token) and every block comes back; a
streamed client that leaves while its headers are held cancels its queued request on the
workers (never computed, nothing leaked); past ``--stream-header-hold-s`` the headers go
out before the first token and the stream is served as usual.

The overload is deterministic: a "hog" prompt whose predicted prefill (T_pre at 10x, ~3 s)
is far beyond the 500 ms TTFT SLO is sent straight to the prefill worker, and the tests wait
until its telemetry shows the queued work before sending anything through a router."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
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
    nats_users_module: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    """pe/de (pe drops queued work as soon as its deadline passed) and two routers with a
    500 ms TTFT SLO: ``shed`` rejects above 1x the SLO, ``open`` never sheds; two that never
    shed with a 60 s TTFT SLO (nothing they send expires): ``patient`` holds a stream's
    headers for the automatic 75 s, ``capped`` for 0.3 s."""
    logs = tmp_path_factory.mktemp("shed-logs")
    url = nats_users_module
    procs = [
        start_worker("prefill", "pe", url, *ARGS, "--expire-margin-s", "0", log_dir=logs),
        start_worker("decode", "de", url, *ARGS, log_dir=logs),
    ]
    try:
        urls = {"nats": url}
        for name, slo_ms, multiple, hold in (
            ("shed", "500", "1", "auto"),
            ("open", "500", "0", "auto"),
            ("patient", "60000", "0", "auto"),
            ("capped", "60000", "0", "0.3"),
        ):
            proc, urls[name] = start_router(
                url,
                "tiny",
                *("--ttft-slo-ms", slo_ms, "--shed-ttft-multiple", multiple),
                *("--stream-header-hold-s", hold),
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
    # No 200 sent yet: a plain 503 with Retry-After, also when streaming (a stream's 200
    # waits for its first token, and none was computed).
    for out in (streamed, whole):
        assert (out.status, out.error_code) == (503, "deadline_expired"), out
        assert out.retry_after is not None and int(out.retry_after) >= 1, out
        assert out.first_token_s is None, out
    assert (await client.result(hog, timeout_s=30)).finish_reason == "length"
    await client.wait_telemetry(
        lambda t: _idle(t) and t["pe"].metrics["expired_total"] == expired0 + 2, 30.0
    )
    assert client.telemetry["pe"].free_blocks == start.free_blocks  # every block back
    assert client.telemetry["de"].free_blocks == client.telemetry["de"].total_blocks


async def test_prefill_busy_fraction_counts_a_running_step_and_falls_when_idle(
    cluster: dict[str, str], client: BusClient
) -> None:
    # FluidRole's P->D bound reads this (shared/policy/busy.py): seconds computing per
    # second over the policy window (5 s), published in the worker's telemetry.
    def pe_busy(t: dict[str, WorkerTelemetry]) -> float:
        return t["pe"].metrics.get("prefill_busy_frac", -1.0)

    await client.wait_telemetry(lambda t: _idle(t) and 0.0 <= pe_busy(t) < 0.2, 30.0)
    hog = await _hog(client)
    # The hog's one ~3 s step counts while it runs, not only once it ends.
    await client.wait_telemetry(lambda t: t["pe"].queue_len > 0 and pe_busy(t) >= 0.3, 20.0)
    assert client.telemetry["de"].metrics["prefill_busy_frac"] == 0.0  # a decode worker
    assert (await client.result(hog, timeout_s=30)).finish_reason == "length"
    await client.wait_telemetry(lambda t: _idle(t) and pe_busy(t) < 0.2, 30.0)


async def _router_metric(session: aiohttp.ClientSession, url: str, name: str, has: str) -> float:
    """The sum of the router's samples of metric ``name`` whose labels contain ``has``."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in "{ " and has in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _router_499s(session: aiohttp.ClientSession, url: str) -> float:
    """The router's count of requests whose client left (status 499)."""
    return await _router_metric(session, url, "fluidpd_router_requests_total", 'status="499"')


async def _hold_expired(session: aiohttp.ClientSession, url: str) -> float:
    return await _router_metric(session, url, "fluidpd_router_stream_hold_expired_total", "")


async def test_a_stream_that_leaves_while_its_headers_are_held_is_cancelled_on_the_workers(
    cluster: dict[str, str], client: BusClient, session: aiohttp.ClientSession
) -> None:
    await client.wait_telemetry(_idle, 30.0)
    start = client.telemetry["pe"]
    prefills0, expired0 = start.metrics["prefills_total"], start.metrics["expired_total"]
    left0 = await _router_499s(session, cluster["patient"])
    # Two hogs (~6 s of prefill) so that the client surely leaves while its request is
    # still queued, however slow this machine is today.
    hogs = [await _hog(client)]
    hog_ids = [5 + i % 300 for i in range(HOG_TOKENS)]
    hogs.append(await client.submit("pe", "de", hog_ids, 2, ttft_budget_s=60.0))  # no expiry
    body = {"model": "tiny", "prompt": SHORT, "max_tokens": 200, "stream": True}
    post = asyncio.ensure_future(session.post(cluster["patient"] + "/v1/completions", json=body))
    # Queued behind the hogs on pe (queue_len counts the running one too); its 60 s deadline
    # is far away, so only a cancel can end it.
    await client.wait_telemetry(lambda t: t["pe"].queue_len >= 3, 10.0)
    assert not post.done()  # its 200 and headers are held: nothing to read yet
    post.cancel()  # the client leaves (its connection closes)
    with contextlib.suppress(asyncio.CancelledError):
        await post
    await client.wait_telemetry(lambda t: t["pe"].queue_len <= 2, 10.0)
    for hog in hogs:
        assert (await client.result(hog, timeout_s=30)).finish_reason == "length"
    await client.wait_telemetry(_idle, 30.0)
    pe = client.telemetry["pe"]
    # Cancelled, not expired, and never computed: the hogs are the only prefills since start.
    assert pe.metrics["prefills_total"] == prefills0 + 2, pe.metrics
    assert pe.metrics["expired_total"] == expired0, pe.metrics
    assert pe.free_blocks == start.free_blocks
    assert client.telemetry["de"].free_blocks == client.telemetry["de"].total_blocks
    assert await _router_499s(session, cluster["patient"]) == left0 + 1


async def test_past_the_hold_a_stream_gets_its_headers_before_its_first_token(
    cluster: dict[str, str], client: BusClient, session: aiohttp.ClientSession
) -> None:
    await client.wait_telemetry(_idle, 30.0)
    expired0 = await _hold_expired(session, cluster["capped"])
    hog = await _hog(client)
    body = {"model": "tiny", "prompt": SHORT, "max_tokens": 4, "stream": True}
    async with session.post(cluster["capped"] + "/v1/completions", json=body) as resp:
        headers_s = time.time()
        assert resp.status == 200
        # The hog still runs for seconds: the request is still queued on pe after its
        # headers went out (a telemetry message sampled after them shows it, behind the
        # running hog).
        await client.wait_telemetry(lambda t: t["pe"].time_s > headers_s, 10.0)
        assert client.telemetry["pe"].queue_len >= 2
        events = [line async for line in resp.content if line.startswith(b"data:")]
    assert events[-1].strip() == b"data: [DONE]", events
    chunks = [json.loads(e[5:]) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks
    assert await _hold_expired(session, cluster["capped"]) == expired0 + 1
    assert (await client.result(hog, timeout_s=30)).finish_reason == "length"
    await client.wait_telemetry(_idle, 30.0)
