"""Small asyncio helpers shared by the services and the transfer layer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

import structlog

T = TypeVar("T")

log = structlog.get_logger("fluidpd.aio")


def resolve(fut: asyncio.Future[T], value: T) -> None:
    """Set ``fut``'s result unless it is already done (cancelled by its waiter, or resolved
    by a racing wake-up). Event-loop thread only: from another thread, schedule it with
    ``loop.call_soon_threadsafe(resolve, fut, value)``."""
    if not fut.done():
        fut.set_result(value)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on a new uvloop event loop (what every FluidPD process
    runs on), or on asyncio's default loop where uvloop is not installed. Returns its
    result; its exceptions propagate."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], timeout_s: float = 5.0) -> None:
    """Cancel ``tasks`` and wait (at most ``timeout_s``) for them to end, cancelling again
    while they run. A task's own exception is retrieved and dropped (so asyncio does not log
    it as never retrieved), never raised here; tasks still running at the deadline are
    logged and left. Only the caller's own cancellation propagates.

    Python 3.11's asyncio.wait_for (used inside nats-py) can swallow a cancellation when
    the awaited future completes at the same moment; a single cancel() is then lost.
    """
    given = list(tasks)
    deadline = time.monotonic() + timeout_s
    pending = {t for t in given if not t.done()}
    while pending and time.monotonic() < deadline:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.05)
    for task in given:
        if task.done() and not task.cancelled():
            task.exception()
    if pending:
        log.warning("aio.tasks_not_stopped", count=len(pending))
