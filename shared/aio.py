"""Small asyncio helpers shared by the services and the transfer layer."""

from __future__ import annotations

import asyncio
from typing import TypeVar

T = TypeVar("T")


def resolve(fut: asyncio.Future[T], value: T) -> None:
    """Set ``fut``'s result unless it is already done (cancelled by its waiter, or resolved
    by a racing wake-up). Event-loop thread only: from another thread, schedule it with
    ``loop.call_soon_threadsafe(resolve, fut, value)``."""
    if not fut.done():
        fut.set_result(value)
