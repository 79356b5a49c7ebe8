"""Decode admission, seen from the prefill side: ask the request's decode worker to reserve
its KV blocks (``AdmitRequest`` → ``AdmitReply`` with a sealed transfer ticket).

A decode worker without capacity now (batch slots or KV) answers ``retry_after_ms``: the
request then **waits** (its prefill KV stays here) and is retried after that backpressure,
or re-paired with another Active decode worker whose telemetry shows room for it
(``find_capacity``), until it is admitted, cancelled, or ``decode_wait_s`` has passed since
it began waiting (then it ends with a clear ``decode_wait_timeout`` error). A decode worker
that stopped decoding answers ``retry_after_ms == 0``: the request is re-paired. Every way of
giving up reports the request's end to the router through ``fail`` (request error item) and
returns None.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable

from services.worker.prefill.prefill_job import PrefillJob
from shared.bus import Bus
from shared.bus.errors import BusError, RemoteError
from shared.messages import AdmitReply, AdmitRequest, Subjects
from shared.policy.roles import Role

Fail = Callable[[PrefillJob, str, str], None]  # (job, error text, error code)
# (job, new worker, part): tells the router before the new worker can stream (prefill_role).
HandOver = Callable[[PrefillJob, str, Role], Awaitable[None]]


class DecodeAdmission:
    """Admits prefill jobs at their decode workers. Event loop only; holds no state per job
    (the job records where it was re-paired to)."""

    def __init__(
        self,
        worker_id: str,
        bus: Bus,
        subjects: Subjects,
        *,
        timeout_s: float,
        decode_wait_s: float,
        fail: Fail,
        hand_over: HandOver,
        observe_stage: Callable[[str, float], None],
        repair: Callable[[str], str | None] | None = None,
        find_capacity: Callable[[str, PrefillJob], str | None] | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.bus = bus
        self.subjects = subjects
        self.timeout_s = timeout_s
        self.decode_wait_s = decode_wait_s
        self._fail = fail
        self._hand_over = hand_over
        self._observe_stage = observe_stage
        # Re-pairing: an Active decode worker to use instead of the given one (or None).
        self.repair = repair
        # An Active decode worker other than the given one with room for the job now.
        self.find_capacity = find_capacity
        # Requests refused for capacity and waiting for it here (telemetry counts them).
        self.waiting: set[str] = set()
        self.wait_timeouts_total = 0
        self.repaired_for_capacity_total = 0

    async def admit_after(
        self, started: asyncio.Future[None], job: PrefillJob
    ) -> AdmitReply | None:
        """The unsplit admit, once the engine thread has the prefill: started earlier,
        its Python work held the GIL the engine thread needed to start (measured: the
        prefill began 0.2 ms later at p50, 1 ms at p99)."""
        await started
        return await self.admit(job, 0)

    async def admit(
        self, job: PrefillJob, suffix_len: int, *, wait: bool = True
    ) -> AdmitReply | None:
        """Reserve at the job's decode worker (``suffix_len`` > 0 proposes a FluidToken
        split). Returns the ok reply, or None once the job failed (reported) or was
        cancelled. With ``wait`` False a capacity refusal is returned as it is (ok False)
        instead of waiting. May change ``job.msg.decode_worker_id`` (re-pairing)."""
        started = time.perf_counter()
        job.timestamps["admit_sent_s"] = time.time()
        try:
            return await self._request(job, suffix_len, wait)
        finally:
            self.waiting.discard(job.request_id)
            job.timestamps["admitted_s"] = time.time()
            self._observe_stage("decode_admission", time.perf_counter() - started)

    async def _request(self, job: PrefillJob, suffix_len: int, wait: bool) -> AdmitReply | None:
        msg = job.msg
        req = AdmitRequest(
            request_id=msg.request_id,
            router_id=msg.router_id,
            prompt_len=job.prompt_len,
            max_tokens=msg.sampling.max_tokens,
            prefill_worker_id=self.worker_id,
            suffix_len=suffix_len,
            sampling=msg.sampling,
            tokens_subject=msg.tokens_subject,
            forced_split=msg.force_steal_ratio is not None,
            suffix_token_ids=tuple(msg.prompt_token_ids[job.prompt_len - suffix_len :])
            if suffix_len
            else (),
        )
        subject = self.subjects.worker_admit(msg.decode_worker_id)
        waiting_since: float | None = None
        while not job.cancelled:
            try:
                reply = await self.bus.request(subject, req, AdmitReply, self.timeout_s)
            except RemoteError as exc:
                self._fail(job, f"decode worker refused: {exc}", exc.code)
                return None
            except BusError as exc:
                self._fail(
                    job, f"decode worker {msg.decode_worker_id} unreachable: {exc}", exc.code
                )
                return None
            if reply.ok:
                return reply
            other: str | None = None
            if reply.retry_after_ms is None:  # it can never take this request
                self._fail(
                    job, f"decode worker has no capacity: {reply.error}", "kv_capacity_exhausted"
                )
                return None
            if reply.retry_after_ms == 0 and self.repair is not None:
                # The paired worker is draining or switched roles: pair with another one.
                other = self.repair(msg.decode_worker_id)
            if other is None:
                if not wait:
                    return reply
                now = time.monotonic()
                if waiting_since is None:
                    waiting_since = now
                    self.waiting.add(job.request_id)
                if now - waiting_since > self.decode_wait_s:
                    self.wait_timeouts_total += 1
                    self._fail(
                        job,
                        f"no decode capacity within the decode-wait timeout of "
                        f"{self.decode_wait_s:g} s ({reply.error})",
                        "decode_wait_timeout",
                    )
                    return None
                if self.find_capacity is not None:
                    other = self.find_capacity(msg.decode_worker_id, job)
                    if other is not None:
                        self.repaired_for_capacity_total += 1
            if other is not None:
                await self._hand_over(job, other, "decode")
                msg = dataclasses.replace(msg, decode_worker_id=other)
                job.msg = msg
                subject = self.subjects.worker_admit(other)
                continue
            # Its backpressure, not a synchronisation (a floor: 0 means "re-pair", and
            # there was no other worker to re-pair with yet).
            await asyncio.sleep(max(reply.retry_after_ms, 20) / 1000)
        return None
