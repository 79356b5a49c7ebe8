"""services/router/disconnect.py on a real aiohttp server and client (in-process, no NATS).

* aiohttp's ``handler_cancellation`` cancels a handler whose client leaves before any byte
  of the response was sent (the header hold relies on it: the claim that it only fires once
  the response has started does not hold on aiohttp 3.14).
* When that cancellation is lost (Python 3.11's ``asyncio.wait_for`` drops a cancel that
  arrives with its result; simulated here by ``uncancel``), ``wait_watching`` still sees
  the closed connection and raises ClientGone.
* ``wait_watching`` returns the result while the client stays, and at ``until_s`` raises
  TimeoutError leaving a queued item in its queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from services.router.disconnect import ClientGone, client_gone, wait_watching

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest_asyncio.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    runners: list[web.AppRunner] = []

    async def start(handler: Handler) -> str:
        app = web.Application()
        app.router.add_post("/", handler)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}/"

    yield start
    for runner in runners:
        await runner.cleanup()


async def _leave_after(url: str, entered: asyncio.Event) -> None:
    """POST to ``url`` and close the connection once the handler has the request, before
    any byte of the response came back."""
    async with aiohttp.ClientSession() as s:
        post = asyncio.ensure_future(s.post(url, json={"prompt": "hi"}))
        await asyncio.wait_for(entered.wait(), 10)
        assert not post.done()  # no headers yet
        post.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await post


async def test_a_client_leaving_before_any_byte_cancels_the_handler(serve) -> None:  # type: ignore[no-untyped-def]
    entered, outcome = asyncio.Event(), asyncio.get_running_loop().create_future()

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        entered.set()
        try:
            await asyncio.Event().wait()  # headers held: nothing to send yet
        except asyncio.CancelledError:
            outcome.set_result("cancelled")
            raise
        return web.Response()

    await _leave_after(await serve(handler), entered)
    assert await asyncio.wait_for(outcome, 10) == "cancelled"


async def test_a_lost_cancellation_is_caught_by_watching_the_connection(serve) -> None:  # type: ignore[no-untyped-def]
    entered, outcome = asyncio.Event(), asyncio.get_running_loop().create_future()
    first_token: asyncio.Queue[str] = asyncio.Queue()  # never gets one

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        task = asyncio.current_task()
        assert task is not None
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            task.uncancel()  # the cancel is lost, as in wait_for's race
        assert client_gone(request)
        try:
            await wait_watching(request, first_token.get(), check_s=0.05)
        except ClientGone:
            outcome.set_result("gone")
            raise
        return web.Response()

    await _leave_after(await serve(handler), entered)
    assert await asyncio.wait_for(outcome, 10) == "gone"


async def test_wait_watching_returns_the_result_and_times_out_keeping_the_item(serve) -> None:  # type: ignore[no-untyped-def]
    results: list[object] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        queue: asyncio.Queue[str] = asyncio.Queue()
        with pytest.raises(TimeoutError):
            await wait_watching(request, queue.get(), until_s=time.time() + 0.2, check_s=0.05)
        queue.put_nowait("token")
        results.append(await wait_watching(request, queue.get(), check_s=0.05))
        queue.put_nowait("late")
        with pytest.raises(TimeoutError):  # already past: the get is cancelled unrun
            await wait_watching(request, queue.get(), until_s=time.time() - 1)
        results.append(queue.get_nowait())  # nothing lost
        return web.Response(text="ok")

    url = await serve(handler)
    async with aiohttp.ClientSession() as s, s.post(url, json={}) as r:
        assert r.status == 200 and await r.text() == "ok"
    assert results == ["token", "late"]
