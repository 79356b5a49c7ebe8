"""The lifecycle every long-running service shares (router, controller, worker runtime)."""

from __future__ import annotations

import gc
from typing import Self


def announce_ready(line: str) -> None:
    """Called by a service's ``__main__`` once it serves: move every object alive now
    (model, tokenizer, libraries) out of the garbage collector's reach, then print the
    readiness line ``fluidpd up`` waits for (printed, so any log level shows it).

    Why freeze: they live as long as the process, and a full collection over them is a
    pause on whatever token is in flight (~7 ms in the router with the tiny tokenizer).
    Mutates the interpreter's GC state; only for a process's entry point.
    """
    gc.freeze()
    print(line, flush=True)


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
