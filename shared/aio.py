"""Small asyncio helpers shared by the services and the transfer layer."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


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
