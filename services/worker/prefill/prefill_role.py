"""Prefill role: FIFO queue, FluidToken split, prefix compute, KV export to the decode worker.

One iteration::

    head of queue -> split decision (Algorithm 1 over the queue; 0 without budget)
      -> admit at the paired decode worker (it reserves blocks, may refuse the steal)
         and compute the prefix here (the whole prompt when not split): one after the
         other for a proposed split (the answer decides what to compute), concurrently
         otherwise, with the first token sampled and streamed as soon as it exists
      -> once the reservation is confirmed, export the prefix KV straight into the
         reserved blocks (background task; the next prefill starts meanwhile); local
         blocks freed when UCX no longer reads them.

A decode worker without capacity makes the request wait (admission.py: its KV held here,
retried after ``retry_after_ms`` or re-paired with a decode worker that has room) in the
background while the next prefill starts, until admitted, cancelled or the decode-wait
timeout; a request that never gets a reservation ends with an error item to the router
(after its first token, if that was already sent), and so does a failed export (the
decode side frees its reservation on its own deadline). Queued prompts whose TTFT deadline
passed by the expiry margin are dropped before they start (``drop_expired``).
A cancel, or a failed step, sends a CancelRequest to the decode side (it frees a
reservation the concurrent admit made, or refuses the admit if that comes later).

Parts this role holds: its queue and job table (prefill_queue.py), the decode admission
(admission.py), the reservation wait and KV export (prefill_handoff.py); the prefix step
and the router notices are prefill_step.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any

import structlog

from services.worker.prefill.admission import DecodeAdmission
from services.worker.prefill.prefill_handoff import PrefillHandoff
from services.worker.prefill.prefill_job import PrefillJob
from services.worker.prefill.prefill_queue import PrefillQueue
from services.worker.prefill.prefill_step import RouterNotices, compute_prefix
from services.worker.stats import PrefillStats
from services.worker.token_stream import TokenStreamer
from shared.bus import Bus
from shared.engine.interface import StepEngine
from shared.messages import AdmitReply, PrefillRequest, Subjects
from shared.policy.busy import BusyClock
from shared.transfer.sender import KVSender

log = structlog.get_logger(__name__)


class PrefillRole:
    """Owns the prefill queue (``queue``), the hand-off of computed prompts (``handoff``)
    and the prefill loop of one worker."""

    def __init__(
        self,
        worker_id: str,
        engine: StepEngine,
        bus: Bus,
        subjects: Subjects,
        sender: KVSender,
        streamer: TokenStreamer,
        executor: Executor,
        publish: Callable[[], Any],
        *,
        flush_now: Callable[[], Awaitable[None]],
        deliver_now: Callable[[], Awaitable[None]],
        secret: bytes,
        admit_timeout_s: float,
        transfer_timeout_s: float,
        decode_wait_s: float = 60.0,
        expire_margin_s: float | None = None,
        split_planner: Callable[[list[PrefillJob], float], dict[str, int]] | None = None,
        repair: Callable[[str], str | None] | None = None,
        find_capacity: Callable[[str, PrefillJob], str | None] | None = None,
        observe_stage: Callable[[str, float], None] = lambda _stage, _s: None,
        observe_step: Callable[[int, float], None] = lambda _tokens, _s: None,
    ) -> None:
        """``split_planner`` (the policy's Algorithm 1; None without FluidToken),
        ``repair``/``find_capacity`` (another Active decode worker, admission.py) and the
        observers (TTFT stage timings, step timings) are the runtime's parts."""
        self.worker_id = worker_id
        self.engine = engine
        self.bm = engine.block_manager
        self.executor = executor
        self._publish = publish
        self.split_planner = split_planner
        self.observe_stage = observe_stage
        self.observe_step = observe_step
        self.notices = RouterNotices(streamer, publish, flush_now, deliver_now)
        # The switcher's way to tell a router that a queued job moved to another worker.
        self.hand_over = self.notices.hand_over
        self.queue = PrefillQueue(self._fail, expire_margin_s=expire_margin_s)
        self.wakeup = self.queue.wakeup
        # Set whenever work leaves this role (a prefill ends, an export ends, the queue is
        # taken): a P->D switch waits on it instead of polling.
        self.progress = asyncio.Event()
        self.handoff = PrefillHandoff(
            engine,
            bus,
            subjects,
            sender,
            secret=secret,
            transfer_timeout_s=transfer_timeout_s,
            progress=self.progress,
            forget=self.queue.forget,
            fail=self._fail,
            observe_stage=observe_stage,
        )
        self.admission = DecodeAdmission(
            worker_id,
            bus,
            subjects,
            timeout_s=admit_timeout_s,
            decode_wait_s=decode_wait_s,
            fail=self._fail,
            hand_over=self.hand_over,
            observe_stage=observe_stage,
            repair=repair,
            find_capacity=find_capacity,
        )
        # Entry points (the handlers', the switcher's, the runtime's): the parts'.
        self.cancel = self.queue.cancel
        self.requeue = self.queue.requeue  # a job take_queued removed that nobody took
        self.cancel_background = self.handoff.cancel_all  # the worker stops
        self.current: PrefillJob | None = None
        self.prefills_total = 0
        self.last_step_s = 0.0
        # Seconds spent in prefix steps (monotonic clock): FluidRole's prefill busy fraction.
        self._busy = BusyClock()

    # ------------------------------------------------------------------ intake
    def enqueue(self, msg: PrefillRequest, seed: int) -> None:
        """Queue ``msg`` (FIFO). Raises ContextLengthError if it can never be served.
        A request whose cancel came first is dropped (not queued)."""
        self.engine.check_prompt(len(msg.prompt_token_ids))
        self.queue.enqueue(msg, seed)

    def take_queued(self) -> list[PrefillJob]:
        """Remove and return every queued job that has not started (for a P->D switch)."""
        jobs = self.queue.take_queued()
        self.progress.set()
        return jobs

    def drop_expired(self, now_s: float) -> int:
        """Drop the queued jobs whose TTFT deadline passed by the expiry margin (each ends
        with a ``deadline_expired`` error). Returns how many were dropped."""
        dropped = self.queue.drop_expired(now_s)
        if dropped:
            self.progress.set()
        return dropped

    # -------------------------------------------------------------------- loop
    async def run(self) -> None:
        while True:
            await self.wakeup.wait()
            self.drop_expired(time.monotonic())
            if not self.queue:
                self.wakeup.clear()
                continue
            need = self.bm.blocks_for_tokens(self.queue.head().prompt_len)
            holders = self.handoff.holders()
            if holders and self.bm.num_free_blocks < need <= self.bm.num_usable_blocks:
                # Earlier prompts still hold our blocks while their KV is on the wire or waits
                # for a decode reservation: wait for one of them to end (it frees its
                # blocks) rather than fail this one.
                await asyncio.wait(list(holders), return_when=asyncio.FIRST_COMPLETED)
                continue
            job = self.queue.pop_head()
            self.current = job
            try:
                await self._serve(job)
            except Exception as exc:  # keep the loop alive; the request fails clearly
                log.exception("prefill_failed", request_id=job.request_id)
                self._fail(
                    job,
                    f"prefill failed: {type(exc).__name__}: {exc}",
                    getattr(exc, "code", "internal_error"),
                )
            finally:
                self.current = None
                self._publish()
                self.progress.set()

    async def _serve(self, job: PrefillJob) -> None:
        msg = job.msg
        suffix_len = 0
        if msg.force_steal_ratio is not None:
            suffix_len = min(int(msg.force_steal_ratio * job.prompt_len), job.prompt_len - 1)
        elif self.split_planner is not None:
            plan = self.split_planner([job, *self.queue], time.monotonic())
            suffix_len = min(plan.get(job.request_id, 0), job.prompt_len - 1)
        if suffix_len:
            # A proposed split: the decode worker may refuse the steal, which changes what
            # we compute, so its answer comes first. A decode worker without capacity now
            # is not waited for here (that would stall this queue): the prompt runs
            # unsplit and waits for decode capacity with its KV held (below).
            admit = await self.admission.admit(
                job, suffix_len, wait=msg.force_steal_ratio is not None
            )
            if admit is None or job.cancelled:
                if admit is not None and admit.ok:
                    await self.handoff.cancel_remote(job)
                return
            if admit.ok:
                await self._serve_split(job, admit)
                return
        await self._serve_unsplit(job)

    async def _serve_split(self, job: PrefillJob, admit: AdmitReply) -> None:
        suffix_len = admit.suffix_len
        prefix_len = job.prompt_len - suffix_len
        try:
            seq_id = self._allocate(job, prefix_len)
        except BaseException:
            await self.handoff.cancel_remote(job)  # free the reservation at once
            raise
        first = await self._compute(job, seq_id, prefix_len, sample=suffix_len == 0)
        if job.cancelled:
            await self.handoff.abandon(job, seq_id)
            return
        await self.notices.first_token(
            job, first
        )  # None (D samples it) unless it refused the steal
        await self.handoff.start_export(job, admit, seq_id, prefix_len, first)

    async def _serve_unsplit(self, job: PrefillJob) -> None:
        """The decode worker reserves while we compute, so the admission round trip is off
        the TTFT path. The export starts only after the reservation: until then (a decode
        worker without capacity) the request waits in the background with its KV held
        here, and the next prefill starts meanwhile."""
        prefix_len = job.prompt_len
        seq_id = self._allocate(job, prefix_len)
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        admitting = asyncio.ensure_future(self.admission.admit_after(started, job))
        try:
            first = await self._compute(job, seq_id, prefix_len, sample=True, started=started)
        except BaseException:
            admitting.cancel()
            await self.handoff.cancel_remote(job)  # frees a reservation the admit may have made
            raise
        if job.cancelled:
            admitting.cancel()
            await self.handoff.abandon(job, seq_id)
            return
        await self.notices.first_token(job, first)
        if admitting.done():
            await self.handoff.admitted(job, admitting, seq_id, prefix_len, first)
            return
        task = asyncio.ensure_future(
            self.handoff.admitted(job, admitting, seq_id, prefix_len, first)
        )
        self.handoff.hold(task)  # holds our blocks: the loop waits on it when short of them

    def _allocate(self, job: PrefillJob, num_tokens: int) -> str:
        """Local blocks for the prompt's KV. Raises NoFreeBlocksError (nothing held)."""
        seq_id = f"pf-{job.request_id}"
        self.bm.allocate(seq_id, num_tokens)
        return seq_id

    async def _compute(
        self,
        job: PrefillJob,
        seq_id: str,
        prefix_len: int,
        sample: bool,
        started: asyncio.Future[None] | None = None,
    ) -> Any:
        """The prefix step (prefill_step.compute_prefix), observed and counted."""
        self._busy.start(time.monotonic())
        try:
            first, self.last_step_s = await compute_prefix(
                self.engine, self.executor, job, seq_id, prefix_len, sample, started
            )
        finally:
            self._busy.stop(time.monotonic())
        self.observe_step(prefix_len, self.last_step_s)
        self.observe_stage("prefill_compute", self.last_step_s)
        self.observe_stage(
            "queue_wait", job.timestamps["prefill_start_s"] - job.timestamps["queued_s"]
        )
        self.prefills_total += 1
        return first

    def _fail(self, job: PrefillJob, error: str, code: str) -> None:
        """End ``job`` with an error item to the router (not if it was cancelled)."""
        self.queue.forget(job.request_id)
        if not job.cancelled:
            self.notices.error(job, error, code)

    # ------------------------------------------------------------- role switch
    def drained(self) -> bool:
        """True when nothing runs, is queued or is being exported (a P->D switch waits)."""
        return self.current is None and not self.handoff.exports and not len(self.queue)

    # --------------------------------------------------------------- snapshots
    def stats(self) -> PrefillStats:
        cur = self.current
        adm = self.admission
        return PrefillStats(
            queue=self.queue.view(),
            queue_len=len(self.queue) + (1 if cur is not None else 0),
            running_prompt_tokens=cur.prompt_len if cur is not None else 0,
            running_started_s=cur.timestamps.get("prefill_start_s") if cur is not None else None,
            handed_off_tokens_total=self.handoff.handed_off_tokens_total,
            split_requests_total=self.handoff.split_requests_total,
            prefills_total=self.prefills_total,
            busy_s_total=self._busy.total_s(time.monotonic()),
            expired_total=self.queue.expired_total,
            admission_waiting=len(adm.waiting),
            decode_wait_timeouts_total=adm.wait_timeouts_total,
            repaired_for_capacity_total=adm.repaired_for_capacity_total,
        )
