"""The role switch's drain wait (``wait_drained``) in isolation: it ends on the roles' progress signal (not on a
polling period) and honours the drain deadline."""

from __future__ import annotations

import asyncio

import pytest

import services.worker.role_switch.switch as switch_mod
from services.worker.role_switch.switch import wait_drained


async def test_drain_ends_on_the_progress_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    # With a re-check period far beyond the test's timeout, only the signal can end it.
    monkeypatch.setattr(switch_mod, "_DRAIN_RECHECK_S", 60.0)
    progress = asyncio.Event()
    work = {"left": 3}

    async def finish_work() -> None:
        while work["left"]:
            await asyncio.sleep(0)
            work["left"] -= 1
            progress.set()  # what the roles do when a request / prefill / export ends

    waiter = asyncio.ensure_future(wait_drained(lambda: work["left"] == 0, progress, 60.0))
    await finish_work()
    async with asyncio.timeout(5.0):
        assert await waiter is True


async def test_drain_deadline_returns_false() -> None:
    async with asyncio.timeout(5.0):
        assert await wait_drained(lambda: False, asyncio.Event(), 0.05) is False


async def test_already_drained_returns_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(switch_mod, "_DRAIN_RECHECK_S", 60.0)
    async with asyncio.timeout(5.0):
        assert await wait_drained(lambda: True, asyncio.Event(), 60.0) is True
