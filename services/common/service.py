"""The lifecycle every long-running service shares (router, controller, worker runtime)."""

from __future__ import annotations

from typing import Self


class Service:
    """``async with service:`` runs ``start()``, and ``stop()`` on exit.

    A start that fails part-way is undone with ``stop()`` before the error propagates, so
    ``stop()`` must be idempotent and safe on a service that only half started (each
    subclass's contract). Subclasses implement both.
    """

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError
