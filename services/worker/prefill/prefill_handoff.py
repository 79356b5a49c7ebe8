"""Prefill role, hand-off side: once a prompt's KV exists here, get it to its decode worker.

    wait for the decode reservation (admission.py; the request may wait for decode
    capacity, its KV held here, while the prefill loop goes on)
      -> export the prefix KV straight into the reserved blocks (background task)
      -> local blocks freed when UCX no longer reads them

A failed or cancelled hand-off frees the local blocks and tells the decode side to drop
its share. ``PrefillRole`` (prefill_role.py) holds one ``PrefillHandoff`` and runs the
queue and the prefill loop; the hand-off tells the role when a job leaves (``forget``).
Event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import structlog

from services.worker.prefill.prefill_job import PrefillJob
from shared.bus import Bus
from shared.bus.errors import BusError
from shared.engine.block_manager import BlockManager
from shared.engine.interface import StepEngine
from shared.errors import FluidPDError
from shared.messages import AdmitReply, CancelRequest, Subjects
from shared.transfer.envelope import TransferTicket
from shared.transfer.errors import TransferError
from shared.transfer.sender import KVSender

log = structlog.get_logger("services.worker.prefill.prefill_role")


class PrefillHandoff:
    """Reservation wait and KV export for ``PrefillRole``. Owns the export and hand-off
    tasks (``exports``, ``handoffs``) and the split counters."""

    def __init__(
        self,
        engine: StepEngine,
        bus: Bus,
        subjects: Subjects,
        sender: KVSender,
        *,
        secret: bytes,
        transfer_timeout_s: float,
        progress: asyncio.Event,
        forget: Callable[[str], None],
        fail: Callable[[PrefillJob, str, str], None],
        observe_stage: Callable[[str, float], None],
    ) -> None:
        """``progress`` is the role's (set when an export or hand-off ends); ``forget``
        drops a job from the role's table; ``fail`` ends a job with an error item."""
        self.engine = engine
        self.bm: BlockManager = engine.block_manager
        self.bus = bus
        self.subjects = subjects
        self.sender = sender
        self._secret = secret
        self.transfer_timeout_s = transfer_timeout_s
        self.progress = progress
        self._forget = forget
        self._fail = fail
        self.observe_stage = observe_stage
        self.exports: set[asyncio.Task[None]] = set()
        # Computed prompts waiting for their decode reservation (KV held here). Not exports:
        # a P->D switch does not wait for them (after the flip they go on waiting for a
        # decode peer; only the export that follows an admission is flushed before it).
        self.handoffs: set[asyncio.Task[None]] = set()
        self.split_requests_total = 0
        self.handed_off_tokens_total = 0

    def holders(self) -> set[asyncio.Task[None]]:
        """The tasks that hold local blocks (their KV is on the wire or waits)."""
        return self.exports | self.handoffs

    def hold(self, task: asyncio.Task[None]) -> None:
        """Track a background hand-off (``admitted``) until it ends."""
        self.handoffs.add(task)
        task.add_done_callback(self._handoff_done)

    def cancel_all(self) -> None:
        """Cancel every export and hand-off task (the worker stops)."""
        for task in [*self.exports, *self.handoffs]:
            task.cancel()

    async def admitted(
        self,
        job: PrefillJob,
        admitting: asyncio.Future[AdmitReply | None],
        seq_id: str,
        prefix_len: int,
        first: int | None,
    ) -> None:
        """Wait for the decode reservation, then export (or free everything)."""
        try:
            admit = await admitting
        except BaseException:  # cancelled (worker stopping) or the admit raised
            admitting.cancel()
            self.free_local(seq_id)
            self._forget(job.request_id)
            raise
        if admit is None or job.cancelled:  # a failed admit already told the router
            self.free_local(seq_id)
            self._forget(job.request_id)
            if admit is not None:
                await self.cancel_remote(job)
            return
        try:
            await self.start_export(job, admit, seq_id, prefix_len, first)
        except Exception as exc:  # in the background: end the request clearly
            log.exception("prefill_failed", request_id=job.request_id)
            self._fail(job, f"prefill failed: {type(exc).__name__}: {exc}", "internal_error")

    async def start_export(
        self, job: PrefillJob, admit: AdmitReply, seq_id: str, prefix_len: int, first: Any
    ) -> None:
        suffix_len = job.prompt_len - prefix_len
        if suffix_len:
            self.split_requests_total += 1
            self.handed_off_tokens_total += suffix_len
        try:
            ticket = TransferTicket.decode(admit.ticket, self._secret)
        except BaseException:  # a ticket we cannot open (wrong cluster secret): free both sides
            await self.abandon(job, seq_id)
            raise
        meta = {"prefix_len": prefix_len, "first_token": first}
        task = asyncio.ensure_future(self._export(job, ticket, seq_id, meta))
        self.exports.add(task)
        task.add_done_callback(self._export_done)

    def free_local(self, seq_id: str) -> None:
        if self.bm.has_sequence(seq_id):
            self.bm.free_sequence(seq_id)

    def _handoff_done(self, task: asyncio.Task[None]) -> None:
        self.handoffs.discard(task)
        self.progress.set()

    def _export_done(self, task: asyncio.Task[None]) -> None:
        self.exports.discard(task)
        self.progress.set()

    async def _export(
        self, job: PrefillJob, ticket: TransferTicket, seq_id: str, meta: dict[str, Any]
    ) -> None:
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.bm.free_sequence(seq_id)

        try:
            await self.sender.send(
                ticket,
                self.engine.arena,
                self.bm.block_table(seq_id)[: ticket.num_blocks],
                timeout_s=self.transfer_timeout_s,
                meta=meta,
                on_source_released=release,
            )
            job.timestamps["kv_sent_s"] = time.time()
            self.observe_stage(
                "kv_export", job.timestamps["kv_sent_s"] - job.timestamps["prefill_end_s"]
            )
        except (TransferError, FluidPDError) as exc:
            log.warning("kv_export_failed", request_id=job.request_id, error=str(exc))
            self._fail(job, f"KV transfer failed: {exc}", exc.code)
        finally:
            release()
            self._forget(job.request_id)

    async def abandon(self, job: PrefillJob, seq_id: str) -> None:
        """Free the prompt's local blocks and tell the decode side to drop its reservation."""
        self.free_local(seq_id)
        await self.cancel_remote(job)

    async def cancel_remote(self, job: PrefillJob) -> None:
        with contextlib.suppress(BusError):  # best effort: D also has its own deadline
            await self.bus.publish(
                self.subjects.worker_cancel(job.msg.decode_worker_id),
                CancelRequest(request_id=job.request_id, reason="cancelled"),
            )
