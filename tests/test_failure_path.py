"""FailurePath (services/worker/failure.py) on its own: what it does after an engine failure
and that ``stop()`` cancels it. The whole path on real processes is test_fail_engine.py."""

from __future__ import annotations

import asyncio
import time

from services.worker.failure import EXIT_ENGINE_FAILED, FailurePath
from shared.engine.block_manager import BlockManager
from shared.policy.roles import FAILED, WorkerState


class Recorder:
    """The runtime's side: what the failure path asked it to do."""

    def __init__(self) -> None:
        self.stopped_admitting = 0
        self.states: list[tuple[WorkerState, str]] = []
        self.state_set = asyncio.Event()

    def stop_admitting(self) -> None:
        self.stopped_admitting += 1

    async def set_state(self, state: WorkerState, reason: str) -> None:
        self.states.append((state, reason))
        self.state_set.set()


def failure_path(rec: Recorder, heartbeat_s: float) -> FailurePath:
    return FailurePath(
        "d0",
        stop_admitting=rec.stop_admitting,
        set_state=rec.set_state,
        block_manager=BlockManager(num_blocks=8, block_size=4),
        transfer_timeout_s=1.0,
        heartbeat_s=heartbeat_s,
    )


async def test_engine_failure_marks_the_worker_failed_then_asks_to_exit() -> None:
    rec = Recorder()
    path = failure_path(rec, heartbeat_s=0.01)
    assert not path.fatal.is_set() and path.exit_status == 0
    path.on_engine_failure(RuntimeError("CUDA error: an illegal memory access"))
    await asyncio.wait_for(path.fatal.wait(), timeout=10.0)
    assert path.exit_status == EXIT_ENGINE_FAILED
    assert rec.stopped_admitting == 1
    assert rec.states == [(FAILED, "engine failed: RuntimeError")]  # the type, not the text
    await path.stop()


async def test_stop_cancels_a_failure_path_in_progress_and_is_idempotent() -> None:
    rec = Recorder()
    path = failure_path(rec, heartbeat_s=60.0)  # it would stay "failed" for 3 minutes
    path.on_engine_failure(RuntimeError("boom"))
    await asyncio.wait_for(rec.state_set.wait(), timeout=10.0)
    started = time.monotonic()
    await path.stop()
    assert time.monotonic() - started < 5.0  # cancelled, not waited out
    await path.stop()
    assert rec.states == [(FAILED, "engine failed: RuntimeError")]
