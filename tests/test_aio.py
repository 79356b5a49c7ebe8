"""shared/aio.cancel_and_wait: what the services' stop() relies on."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from shared.aio import cancel_and_wait


async def _forever() -> None:
    await asyncio.Event().wait()


async def _raises() -> None:
    raise RuntimeError("a background loop died")


async def test_cancels_running_tasks_given_as_any_iterable() -> None:
    tasks = [asyncio.ensure_future(_forever()) for _ in range(3)]
    await asyncio.sleep(0)  # let them start: a cancel then lands inside their await
    await cancel_and_wait(t for t in tasks)  # a generator, not a list
    assert all(t.cancelled() for t in tasks)


async def test_a_finished_tasks_exception_is_retrieved_not_raised() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
    task = asyncio.ensure_future(_raises())
    await asyncio.wait([task])
    await cancel_and_wait([task])  # no raise
    del task
    gc.collect()  # an unretrieved task exception is reported when the task is collected
    assert not [c for c in reported if "never retrieved" in str(c.get("message"))]
