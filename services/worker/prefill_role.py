"""Prefill role: FIFO queue, FluidToken split, prefix compute, KV export to the decode worker.

One iteration::

    head of queue -> split decision (Algorithm 1 over the queue; 0 without budget)
      -> admit at the paired decode worker (it reserves blocks, may refuse the steal)
         and compute the prefix here (the whole prompt when not split): one after the
         other for a proposed split (the answer decides what to compute), concurrently
         otherwise, with the first token sampled and streamed as soon as it exists
      -> once the reservation is confirmed, export the prefix KV straight into the reserved blocks (background task; the next
         prefill starts meanwhile); local blocks freed when UCX no longer reads them.

A decode worker without capacity makes the request wait (admission.py: its KV held here,
retried after ``retry_after_ms`` or re-paired with a decode worker that has room) in the
background while the next prefill starts, until admitted, cancelled or the decode-wait
timeout; a request that never gets a reservation ends with an error item to the router
(after its first token, if that was already sent), and so does a failed export (the
decode side frees its reservation on its own deadline). Queued prompts whose TTFT deadline
passed by the expiry margin are dropped before they start (``drop_expired``).
A cancel, or a failed step, sends a CancelRequest to the decode side (it frees a
reservation the concurrent admit made, or refuses the admit if that comes later).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any

import structlog

from services.worker.admission import DecodeAdmission
from services.worker.params import engine_params
from services.worker.prefill_handoff import PrefillHandoff
from services.worker.prefill_job import PrefillJob
from services.worker.stats import PrefillStats
from services.worker.token_stream import TokenStreamer, wire_logprobs
from shared.aio import resolve
from shared.bus import Bus
from shared.engine.batch import StepInput
from shared.engine.engine import SampleSpec
from shared.engine.interface import StepEngine
from shared.engine.logprobs import StepOutput, prompt_spec
from shared.messages import (
    AdmitReply,
    PrefillRequest,
    Subjects,
    TokenItem,
)
from shared.policy.admission import SheddingConfig, is_expired
from shared.policy.pressure import QueuedRequest
from shared.policy.roles import Role
from shared.transfer.sender import KVSender

_MAX_EARLY_CANCELS = 4096  # bounded memory of ids cancelled before their request came

log = structlog.get_logger(__name__)


class PrefillRole(PrefillHandoff):
    """Owns the prefill queue and the prefill loop of one worker."""

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
        self.bus = bus
        self.subjects = subjects
        self.sender = sender
        self.streamer = streamer
        self.executor = executor
        self._publish = publish
        self._flush_now = flush_now
        self._secret = secret
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
        self.transfer_timeout_s = transfer_timeout_s
        # Queued work whose TTFT deadline passed by this margin is dropped (None: never).
        self.shedding = SheddingConfig(ttft_multiple=0.0, expire_margin_s=expire_margin_s)
        self.expired_total = 0
        self.split_planner = split_planner
        self.queue: deque[PrefillJob] = deque()
        self.jobs: dict[str, PrefillJob] = {}
        # Ids cancelled before their PrefillRequest arrived (cancel and request travel on
        # different subjects; e.g. a client gone while this worker was stalled): the
        # request is dropped when it comes. Bounded, oldest first.
        self._cancelled_early: dict[str, None] = {}
        self.exports: set[asyncio.Task[None]] = set()
        # Computed prompts waiting for their decode reservation (KV held here). Not exports:
        # a P->D switch does not wait for them (after the flip they go on waiting for a
        # decode peer; only the export that follows an admission is flushed before it).
        self.handoffs: set[asyncio.Task[None]] = set()
        self.current: PrefillJob | None = None
        self.wakeup = asyncio.Event()
        # Set whenever work leaves this role (a prefill ends, an export ends, the queue is
        # taken): a P->D switch waits on it instead of polling.
        self.progress = asyncio.Event()
        self.admitting = True
        self.handed_off_tokens_total = 0
        self.split_requests_total = 0
        self.prefills_total = 0
        self.last_step_s = 0.0
        self.last_prefill_tokens = 0
        self.observe_stage = observe_stage
        self.observe_step = observe_step

    # ------------------------------------------------------------------ intake
    def enqueue(self, msg: PrefillRequest, seed: int) -> None:
        """Queue ``msg`` (FIFO). Raises ContextLengthError if it can never be served.
        A request whose cancel came first is dropped (not queued)."""
        self.engine.check_prompt(len(msg.prompt_token_ids))
        if self._cancelled_early.pop(msg.request_id, "absent") is None:
            return
        now = time.monotonic()
        budget_s = max(0.0, msg.ttft_deadline_s - msg.arrival_time_s)
        waited_s = max(0.0, time.time() - msg.arrival_time_s)
        job = PrefillJob(msg, now, now + budget_s - waited_s, seed, arrival_s=now - waited_s)
        job.timestamps["queued_s"] = time.time()
        self.queue.append(job)
        self.jobs[msg.request_id] = job
        self.wakeup.set()

    def cancel(self, request_id: str) -> bool:
        job = self.jobs.pop(request_id, None)
        if job is None:
            self._cancelled_early[request_id] = None
            while len(self._cancelled_early) > _MAX_EARLY_CANCELS:
                self._cancelled_early.pop(next(iter(self._cancelled_early)))
            return False
        job.cancelled = True
        if job in self.queue:
            self.queue.remove(job)
        return True

    def take_queued(self) -> list[PrefillJob]:
        """Remove and return every queued job that has not started (for a P->D switch)."""
        jobs = list(self.queue)
        self.queue.clear()
        for job in jobs:
            self.jobs.pop(job.request_id, None)
        self.progress.set()
        return jobs

    def drop_expired(self, now_s: float) -> int:
        """Drop the queued (not started) jobs whose TTFT deadline passed by the expiry
        margin, ending each with a ``deadline_expired`` error to the router. A queued job
        holds no blocks and no decode reservation yet, so nothing else is freed. Returns
        how many were dropped."""
        expired = [j for j in self.queue if is_expired(j.deadline_s, now_s, self.shedding)]
        for job in expired:
            self.queue.remove(job)
            self.expired_total += 1
            late_s = now_s - job.deadline_s
            log.info("prefill_expired", request_id=job.request_id, late_s=round(late_s, 3))
            self._fail(
                job,
                f"dropped from the prefill queue: its TTFT deadline passed {late_s:.1f} s ago "
                "(overloaded; retry later)",
                "deadline_expired",
            )
        if expired:
            self.progress.set()
        return len(expired)

    # -------------------------------------------------------------------- loop
    async def run(self) -> None:
        while True:
            await self.wakeup.wait()
            self.drop_expired(time.monotonic())
            if not self.queue:
                self.wakeup.clear()
                continue
            need = self.bm.blocks_for_tokens(self.queue[0].prompt_len)
            holders = self.exports | self.handoffs
            if holders and self.bm.num_free_blocks < need <= self.bm.num_usable_blocks:
                # Earlier prompts still hold our blocks while their KV is on the wire or waits
                # for a decode reservation: wait for one of them to end (it frees its
                # blocks) rather than fail this one.
                await asyncio.wait(list(holders), return_when=asyncio.FIRST_COMPLETED)
                continue
            job = self.queue.popleft()
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
                    await self._cancel_remote(job)
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
            await self._cancel_remote(job)  # free the reservation at once
            raise
        first = await self._compute(job, seq_id, prefix_len, sample=suffix_len == 0)
        if job.cancelled:
            await self._abandon(job, seq_id)
            return
        await self._stream_first(job, first)  # None (D samples it) unless it refused the steal
        await self._start_export(job, admit, seq_id, prefix_len, first)

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
            await self._cancel_remote(job)  # frees a reservation the admit may have made
            raise
        if job.cancelled:
            admitting.cancel()
            await self._abandon(job, seq_id)
            return
        await self._stream_first(job, first)
        if admitting.done():
            await self._admitted(job, admitting, seq_id, prefix_len, first)
            return
        task = asyncio.ensure_future(self._admitted(job, admitting, seq_id, prefix_len, first))
        self.handoffs.add(task)  # holds our blocks: the loop waits on it when short of them
        task.add_done_callback(self._handoff_done)

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
        """Run the prefix in the engine thread; the first token when ``sample``. Frees
        ``seq_id`` if the step fails. ``started`` is resolved (on this loop) as soon as
        the engine thread has taken the step."""
        msg = job.msg
        step = StepInput(seq_id, msg.prompt_token_ids[:prefix_len], 0, self.bm.block_table(seq_id))
        spec = SampleSpec(engine_params(msg.sampling), 0, job.seed) if sample else None
        # Prompt logprobs of the rows computed here: tokens 1..prefix_len (the last one is
        # the first suffix token on a split; the decode worker scores the rest).
        pspec = prompt_spec(msg.prompt_token_ids, 0, prefix_len, msg.sampling.prompt_logprobs)
        job.timestamps["prefill_start_s"] = time.time()
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()

        def run_step() -> StepOutput:
            if started is not None:
                loop.call_soon_threadsafe(resolve, started, None)
            result: StepOutput = self.engine.step_full([step], [spec], [pspec])
            return result

        try:
            out = await loop.run_in_executor(self.executor, run_step)
        except BaseException:
            self.bm.free_sequence(seq_id)
            raise
        first = out.tokens[0]
        job.first_logprobs = wire_logprobs(out.logprobs)
        job.prompt_logprobs = wire_logprobs(out.prompt_logprobs[0])
        self.last_step_s = time.perf_counter() - t0
        job.timestamps["prefill_end_s"] = time.time()
        self.last_prefill_tokens = prefix_len
        self.observe_step(prefix_len, self.last_step_s)
        self.observe_stage("prefill_compute", self.last_step_s)
        self.observe_stage(
            "queue_wait", job.timestamps["prefill_start_s"] - job.timestamps["queued_s"]
        )
        self.prefills_total += 1
        return first

    async def _stream_first(self, job: PrefillJob, first: int | None) -> None:
        """Send the first token to the router now (TTFT); when D samples it, only the
        prompt logprobs computed here (if asked). Returns once it is on its way: the export
        that follows takes this loop for a while (measured: the token waited behind it,
        +0.3 ms TTFT at p50)."""
        if first is None and not job.prompt_logprobs:
            return
        self.streamer.add(
            job.msg.tokens_subject,
            TokenItem(
                request_id=job.request_id,
                index=0,
                token_ids=(first,) if first is not None else (),
                timestamps=dict(job.timestamps) if first is not None else {},
                logprobs=job.first_logprobs if first is not None else (),
                prompt_logprobs_start=1 if job.prompt_logprobs else 0,
                prompt_logprobs=job.prompt_logprobs,
            ),
        )
        await self._flush_now()

    async def hand_over(self, job: PrefillJob, to_worker_id: str, role: Role) -> None:
        """Tell the router that ``to_worker_id`` now serves the ``role`` part of ``job``.
        Returns once the notice is on the bus: call it before that worker can stream
        anything for the job (the router drops items from workers it was not told of)."""
        self.streamer.add(
            job.msg.tokens_subject,
            TokenItem(request_id=job.request_id, handed_to=to_worker_id, handed_role=role),
        )
        await self._flush_now()

    def _fail(self, job: PrefillJob, error: str, code: str) -> None:
        self.jobs.pop(job.request_id, None)
        if job.cancelled:
            return
        self.streamer.add(
            job.msg.tokens_subject,
            TokenItem(
                request_id=job.request_id, finish_reason="error", error=error, error_code=code
            ),
        )
        self._publish()

    # ------------------------------------------------------------- role switch
    def set_admitting(self, admitting: bool) -> None:
        """Accept prefill work (True) or not (a drain, a failure). Mutates."""
        self.admitting = admitting

    def drained(self) -> bool:
        """True when nothing runs, is queued or is being exported (a P->D switch waits)."""
        return self.current is None and not self.exports and not self.queue

    def requeue(self, job: PrefillJob) -> None:
        """Put back a job ``take_queued`` removed (no other worker took it)."""
        self.queue.append(job)
        self.jobs[job.request_id] = job
        self.wakeup.set()

    def cancel_background(self) -> None:
        """Cancel every export and hand-off task (the worker stops)."""
        for task in [*self.exports, *self.handoffs]:
            task.cancel()

    # --------------------------------------------------------------- snapshots
    def stats(self) -> PrefillStats:
        cur = self.current
        adm = self.admission
        return PrefillStats(
            queue=tuple(
                QueuedRequest(j.request_id, j.arrival_s, j.prompt_len, j.msg.decode_worker_id)
                for j in self.queue
            ),
            queue_len=self.queue_len,
            running_prompt_tokens=cur.prompt_len if cur is not None else 0,
            running_started_s=cur.timestamps.get("prefill_start_s") if cur is not None else None,
            handed_off_tokens_total=self.handed_off_tokens_total,
            split_requests_total=self.split_requests_total,
            prefills_total=self.prefills_total,
            expired_total=self.expired_total,
            admission_waiting=len(adm.waiting),
            decode_wait_timeouts_total=adm.wait_timeouts_total,
            repaired_for_capacity_total=adm.repaired_for_capacity_total,
        )

    # --------------------------------------------------------------- telemetry
    @property
    def queue_len(self) -> int:
        return len(self.queue) + (1 if self.current else 0)
