"""Noticing a client that left while the router has nothing to write to it.

The primary signal is aiohttp's ``handler_cancellation``: a closed connection cancels the
handler, whether or not its response has started. That cancellation can be lost, though:
on Python 3.11 ``asyncio.wait_for`` (which the NATS client's request uses) returns a result
that arrives in the same loop iteration as the cancel and drops the cancel, so a client
that leaves just as the prefill worker's Ack comes back is never cancelled. While a
response is being written a closed connection also shows up as a write error; while the
router holds a stream's headers, or waits for a whole answer, nothing is written, so
``wait_watching`` also looks at the connection itself every ``check_s``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

from aiohttp import web

T = TypeVar("T")
# How often a held request looks at its client's connection. aiohttp has no public
# "connection lost" callback; a lost cancellation (above) is rare, so a second's delay in
# noticing it costs little, and a wakeup per held request per second is cheap.
CHECK_S = 1.0


class ClientGone(ConnectionResetError):
    """The client closed its connection before the response was sent."""


def client_gone(request: web.Request) -> bool:
    """True when the client's connection is closed or closing. Pure."""
    transport = request.transport
    return transport is None or transport.is_closing()


async def wait_watching(
    request: web.Request,
    aw: Awaitable[T],
    *,
    until_s: float | None = None,
    check_s: float = CHECK_S,
) -> T:
    """Await ``aw`` while ``request``'s client stays connected. Raises ClientGone when the
    connection closed first, TimeoutError when the wall-clock time ``until_s`` passed first
    (``aw`` is cancelled either way: a cancelled ``asyncio.Queue.get`` leaves its item in
    the queue), and whatever ``aw`` raises."""
    task = asyncio.ensure_future(aw)
    try:
        while True:
            if client_gone(request):
                raise ClientGone("the client closed its connection")
            wait_s = check_s
            if until_s is not None:
                left_s = until_s - time.time()
                if left_s <= 0:
                    raise TimeoutError
                wait_s = min(wait_s, left_s)
            done, _ = await asyncio.wait({task}, timeout=wait_s)
            if done:
                return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
