"""Prefill role, hand-off side: once a prompt's KV exists here, get it to its decode worker.

    wait for the decode reservation (admission.py; the request may wait for decode
    capacity, its KV held here, while the prefill loop goes on)
      -> export the prefix KV straight into the reserved blocks (background task)
      -> local blocks freed when UCX no longer reads them

A failed or cancelled hand-off frees the local blocks and tells the decode side to drop
its part. ``PrefillRole`` (prefill_role.py) adds the queue and the prefill loop on top of
this base class; both act on the role's job table from the event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import structlog

from services.worker.prefill_job import PrefillJob
from shared.bus import Bus
from shared.bus.errors import BusError
from shared.engine.block_manager import BlockManager
from shared.engine.interface import StepEngine
from shared.errors import FluidPDError
from shared.messages import AdmitReply, CancelRequest, Subjects
from shared.transfer.envelope import TransferTicket
from shared.transfer.errors import TransferError
from shared.transfer.sender import KVSender

log = structlog.get_logger("services.worker.prefill_role")


class PrefillHandoff:
    """Reservation wait and KV export for ``PrefillRole``. A base class, not a service of
    its own: the attributes below are the role's (set in ``PrefillRole.__init__``)."""

    engine: StepEngine
    bm: BlockManager
    bus: Bus
    subjects: Subjects
    sender: KVSender
    _secret: bytes
    transfer_timeout_s: float
    jobs: dict[str, PrefillJob]
    exports: set[asyncio.Task[None]]
    handoffs: set[asyncio.Task[None]]
    progress: asyncio.Event
    split_requests_total: int
    handed_off_tokens_total: int
    observe_stage: Callable[[str, float], None]

    def _fail(self, job: PrefillJob, error: str, code: str) -> None:
        """End ``job`` with an error item to the router (the role's; see PrefillRole)."""
        raise NotImplementedError

    async def _admitted(
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
            self._free_local(seq_id)
            self.jobs.pop(job.request_id, None)
            raise
        if admit is None or job.cancelled:  # a failed admit already told the router
            self._free_local(seq_id)
            self.jobs.pop(job.request_id, None)
            if admit is not None:
                await self._cancel_remote(job)
            return
        try:
            await self._start_export(job, admit, seq_id, prefix_len, first)
        except Exception as exc:  # in the background: end the request clearly
            log.exception("prefill_failed", request_id=job.request_id)
            self._fail(job, f"prefill failed: {type(exc).__name__}: {exc}", "internal_error")

    async def _start_export(
        self, job: PrefillJob, admit: AdmitReply, seq_id: str, prefix_len: int, first: Any
    ) -> None:
        suffix_len = job.prompt_len - prefix_len
        if suffix_len:
            self.split_requests_total += 1
            self.handed_off_tokens_total += suffix_len
        try:
            ticket = TransferTicket.decode(admit.ticket, self._secret)
        except BaseException:  # a ticket we cannot open (wrong cluster secret): free both sides
            await self._abandon(job, seq_id)
            raise
        meta = {"prefix_len": prefix_len, "first_token": first}
        task = asyncio.ensure_future(self._export(job, ticket, seq_id, meta))
        self.exports.add(task)
        task.add_done_callback(self._export_done)

    def _free_local(self, seq_id: str) -> None:
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
            self.jobs.pop(job.request_id, None)

    async def _abandon(self, job: PrefillJob, seq_id: str) -> None:
        """Free the prompt's local blocks and tell the decode side to drop its part."""
        self._free_local(seq_id)
        await self._cancel_remote(job)

    async def _cancel_remote(self, job: PrefillJob) -> None:
        with contextlib.suppress(BusError):  # best effort: D also has its own deadline
            await self.bus.publish(
                self.subjects.worker_cancel(job.msg.decode_worker_id),
                CancelRequest(request_id=job.request_id, reason="cancelled"),
            )
