"""The prefill role's jobs: the FIFO of queued prompts and the table of every job the role
holds (queued, running, waiting for its decode reservation, exporting), with the ids
cancelled before their request came and the expiry of queued work whose TTFT deadline
passed (shedding, docs/operations.md).

Owned by ``PrefillRole`` (prefill_role.py), which runs the head of the queue; event loop
only.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterator

import structlog

from services.worker.prefill.prefill_job import PrefillJob
from shared.messages import PrefillRequest
from shared.policy.admission import SheddingConfig, is_expired
from shared.policy.prefill_pressure import QueuedRequest

_MAX_EARLY_CANCELS = 4096  # bounded memory of ids cancelled before their request came

log = structlog.get_logger("services.worker.prefill.prefill_role")

Fail = Callable[[PrefillJob, str, str], None]  # (job, error text, error code)


class PrefillQueue:
    """Mutated by its methods only. ``wakeup`` is set when a job is queued."""

    def __init__(self, fail: Fail, *, expire_margin_s: float | None) -> None:
        """``fail`` ends a job with an error item to the router (the role's)."""
        self._fail = fail
        # Queued work whose TTFT deadline passed by this margin is dropped (None: never).
        self.shedding = SheddingConfig(ttft_multiple=0.0, expire_margin_s=expire_margin_s)
        self._queue: deque[PrefillJob] = deque()
        self.jobs: dict[str, PrefillJob] = {}
        # Ids cancelled before their PrefillRequest arrived (cancel and request travel on
        # different subjects; e.g. a client gone while this worker was stalled): the
        # request is dropped when it comes. Bounded, oldest first.
        self._cancelled_early: dict[str, None] = {}
        self.wakeup = asyncio.Event()
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[PrefillJob]:
        return iter(self._queue)

    def head(self) -> PrefillJob:
        return self._queue[0]

    def pop_head(self) -> PrefillJob:
        """Take the head to run it (it stays in ``jobs``)."""
        return self._queue.popleft()

    def view(self) -> tuple[QueuedRequest, ...]:
        """The queue as the policy sees it (head first)."""
        return tuple(j.queued_request() for j in self._queue)

    def enqueue(self, msg: PrefillRequest, seed: int) -> None:
        """Queue ``msg`` (FIFO). A request whose cancel came first is dropped (not queued)."""
        if self._cancelled_early.pop(msg.request_id, "absent") is None:
            return
        now = time.monotonic()
        budget_s = max(0.0, msg.ttft_deadline_s - msg.arrival_time_s)
        waited_s = max(0.0, time.time() - msg.arrival_time_s)
        job = PrefillJob(msg, now, now + budget_s - waited_s, seed, arrival_s=now - waited_s)
        job.timestamps["queued_s"] = time.time()
        self._queue.append(job)
        self.jobs[msg.request_id] = job
        self.wakeup.set()

    def requeue(self, job: PrefillJob) -> None:
        """Put back a job ``take_queued`` removed (no other worker took it)."""
        self._queue.append(job)
        self.jobs[job.request_id] = job
        self.wakeup.set()

    def forget(self, request_id: str) -> None:
        """The job left this role (done, failed, handed away). Unknown ids are ignored."""
        self.jobs.pop(request_id, None)

    def cancel(self, request_id: str) -> bool:
        """Mark ``request_id`` cancelled (and unqueue it); remember an unknown id so its
        request is dropped when it comes. True if the job was held here."""
        job = self.jobs.pop(request_id, None)
        if job is None:
            self._cancelled_early[request_id] = None
            while len(self._cancelled_early) > _MAX_EARLY_CANCELS:
                self._cancelled_early.pop(next(iter(self._cancelled_early)))
            return False
        job.cancelled = True
        if job in self._queue:
            self._queue.remove(job)
        return True

    def take_queued(self) -> list[PrefillJob]:
        """Remove and return every queued job that has not started (for a P->D switch)."""
        jobs = list(self._queue)
        self._queue.clear()
        for job in jobs:
            self.jobs.pop(job.request_id, None)
        return jobs

    def drop_expired(self, now_s: float) -> int:
        """Drop the queued (not started) jobs whose TTFT deadline passed by the expiry
        margin, ending each with a ``deadline_expired`` error to the router. A queued job
        holds no blocks and no decode reservation yet, so nothing else is freed. Returns
        how many were dropped."""
        expired = [j for j in self._queue if is_expired(j.deadline_s, now_s, self.shedding)]
        for job in expired:
            self._queue.remove(job)
            self.expired_total += 1
            late_s = now_s - job.deadline_s
            log.info("prefill_expired", request_id=job.request_id, late_s=round(late_s, 3))
            self._fail(
                job,
                f"dropped from the prefill queue: its TTFT deadline passed {late_s:.1f} s ago "
                "(overloaded; retry later)",
                "deadline_expired",
            )
        return len(expired)
