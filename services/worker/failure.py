"""A worker whose engine failed: mark it ``failed``, make sure nothing it held leaks, exit.

A failed step leaves the engine in an unknown state (a CUDA error is sticky; an OOM can
leave allocator state behind), so the worker does not try to serve on: the decode role has
already ended every request with an ``engine_failed`` error item, freed their blocks and
stopped admitting decode work (``DecodeRole._fail_all``, the one caller). Here the worker

1. writes state ``failed`` to the registry and the state events (terminal; the handlers
   refuse work of either role in any state but ``active``, and routers and prefill workers
   pair only with ``active`` workers, so it leaves the serving set at once; ``fluidpd ctl
   status`` shows ``failed``);
2. waits (bounded by the transfer timeout) until cancelled KV receives have released their
   reservations, then checks the block manager's invariants and logs the pool;
3. stays ``failed`` for three heartbeat periods (telemetry keeps reporting its freed pool
   and state meanwhile), then asks the process to exit with ``EXIT_ENGINE_FAILED`` so a
   supervisor (compose ``restart: unless-stopped``, systemd, Kubernetes) starts a fresh one.

``FailurePath`` is what the runtime holds: the decode role calls its ``on_engine_failure``,
which runs the steps above as a task; ``fatal`` is set once the process should exit with
``exit_status``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog

from shared.aio import cancel_and_wait
from shared.engine.block_manager import BlockManager
from shared.policy.roles import FAILED, WorkerState

log = structlog.get_logger(__name__)

EXIT_ENGINE_FAILED = 3  # the worker's exit status after an engine failure
_POLL_S = 0.02  # re-check period while cancelled receives release their blocks


class FailurePath:
    """Takes the worker out once an engine step failed (module doc). ``stop()``
    (idempotent) cancels that."""

    def __init__(
        self,
        worker_id: str,
        *,
        set_state: Callable[[WorkerState, str], Awaitable[None]],
        block_manager: BlockManager,
        transfer_timeout_s: float,
        heartbeat_s: float,
    ) -> None:
        self.worker_id = worker_id
        self._set_state = set_state
        self._bm = block_manager
        self.transfer_timeout_s = transfer_timeout_s
        self.heartbeat_s = heartbeat_s
        self.fatal = asyncio.Event()  # set when the process must exit with exit_status
        self.exit_status = 0
        self._tasks: list[asyncio.Task[None]] = []

    def on_engine_failure(self, exc: BaseException) -> None:
        """The decode role already ended its requests; take the worker out."""
        self._tasks.append(asyncio.ensure_future(self._fail(type(exc).__name__)))

    async def _fail(self, error: str) -> None:
        """Steps 1-3 of the module doc, then ``fatal`` with ``EXIT_ENGINE_FAILED``. Never
        raises (a failure to publish is logged; the exit still happens)."""
        try:
            await self._set_state(FAILED, f"engine failed: {error}")
            bm = self._bm
            deadline = time.monotonic() + self.transfer_timeout_s + 1.0
            # A cancelled receive frees its reservation only once UCX let go of its buffers.
            while bm.num_reserved_blocks and time.monotonic() < deadline:
                await asyncio.sleep(_POLL_S)
            integrity = "ok"
            try:
                bm.check_integrity()
            except Exception as exc:  # reported, not raised: the process exits either way
                integrity = f"{type(exc).__name__}: {exc}"
            log.error(
                "worker_failed",
                worker_id=self.worker_id,
                error=error,
                free_blocks=bm.num_free_blocks,
                usable_blocks=bm.num_usable_blocks,
                reserved_blocks=bm.num_reserved_blocks,
                integrity=integrity,
                exit_status=EXIT_ENGINE_FAILED,
            )
            await asyncio.sleep(3 * self.heartbeat_s)  # a period: others see "failed"
        except Exception:
            log.exception("worker_fail_path_failed", worker_id=self.worker_id)
        finally:
            self._exit_with(EXIT_ENGINE_FAILED)

    def _exit_with(self, status: int) -> None:
        self.exit_status = status
        self.fatal.set()

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks = []
