"""``ServeHandle``: one running subscription of the Bus (a served subject or a stream) and the
tasks its messages started; stopping it unsubscribes and cancels them."""

from __future__ import annotations

import asyncio
import contextlib

import nats.errors
from nats.aio.subscription import Subscription


class ServeHandle:
    """A running handler subscription; ``stop()`` unsubscribes (idempotent) and leaves
    ``owned_by`` (the bus's list of live handles, so subscriptions stopped early — a role
    switch moves one — do not pile up there)."""

    def __init__(
        self,
        sub: Subscription,
        tasks: set[asyncio.Task[None]],
        owned_by: list[ServeHandle] | None = None,
    ) -> None:
        self._sub = sub
        self._tasks = tasks
        self._owned_by = owned_by
        self._stopped = False
        if owned_by is not None:
            owned_by.append(self)

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._owned_by is not None:
            self._owned_by.remove(self)
        with contextlib.suppress(nats.errors.Error, OSError):  # connection already gone
            await self._sub.unsubscribe()
        for task in list(self._tasks):
            task.cancel()
