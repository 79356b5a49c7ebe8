"""A router stand-in for benchmarks and tests: talks to workers over the bus only (no HTTP).

``BenchBusClient`` submits ``PrefillRequest``s to a chosen prefill/decode pair and records,
per request, every streamed token with its receive time (perf counter and wall clock) and
its publisher; it also keeps the latest telemetry of each worker, every ``StateEvent`` and
the registry (``RegistryWatcher``), and sends switch commands. Waiting is event-driven:
``wait_until`` re-checks its predicate whenever a token batch, telemetry or state event
arrives. Event-loop only; not thread-safe.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shared.bus import Bus
from shared.bus.config import BusConfig
from shared.bus.registry_watcher import RegistryWatcher
from shared.messages import (
    ABORT_REASONS,
    Ack,
    CancelRequest,
    PrefillRequest,
    SamplingParams,
    StateEvent,
    StatusReply,
    StatusRequest,
    Subjects,
    SwitchCommand,
    SwitchReply,
    TokenBatch,
    TokenLogprob,
    WorkerTelemetry,
)
from shared.policy.roles import ACTIVE, Role


@dataclass
class StreamRecord:
    """One request as the client saw it. Times: perf counter (``*_s``) and wall clock."""

    request_id: str
    sent_s: float
    sent_wall_s: float
    token_ids: list[int] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    recv_s: list[float] = field(default_factory=list)
    recv_wall_s: list[float] = field(default_factory=list)
    publishers: list[str] = field(default_factory=list)
    # Hand-over notices (TokenItem.handed_to): (publisher, to, role, tokens received before).
    hand_overs: list[tuple[str, str, str, int]] = field(default_factory=list)
    timestamps: dict[str, float] = field(default_factory=dict)
    finish_reason: str | None = None
    error: str | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # Only when asked (submit's logprobs / prompt_logprobs): per token, per prompt position.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    # A stop/length end seen before all its tokens: (end position, reason, error).
    _end: tuple[int, str, str | None] | None = field(default=None, repr=False)

    def place(
        self,
        pos: int,
        token: int,
        recv_s: float,
        recv_wall_s: float,
        by: str,
        logprob: TokenLogprob | None = None,
    ) -> None:
        """Record one token at its stream position. Mutates the per-token lists.

        Tokens from two publishers can arrive out of order: P's first token and D's second
        leave over different NATS connections, and the server owes no order across them.
        The router orders by position (``services/router/streams.py``); so does this
        record, so ``token_ids`` reads in stream order. A repeated position is kept (after
        the first), so ``indices == list(range(n))`` still catches repeats and gaps."""
        i = len(self.indices)
        while i and self.indices[i - 1] > pos:  # almost always 0 steps: in-order arrival
            i -= 1
        self.indices.insert(i, pos)
        self.token_ids.insert(i, token)
        self.recv_s.insert(i, recv_s)
        self.recv_wall_s.insert(i, recv_wall_s)
        self.publishers.insert(i, by)
        if logprob is not None:  # asked for: every token carries one
            self.logprobs.insert(i, logprob)

    def end_at(self, end_pos: int, finish_reason: str, error: str | None) -> None:
        """Note an end item. An abort ends the record now; a stop/length end waits until
        every position before ``end_pos`` has arrived (``finish_if_whole``). Mutates."""
        if finish_reason in ABORT_REASONS:
            self.finish_reason, self.error = finish_reason, error
            self.done.set()
        elif self._end is None:
            self._end = (end_pos, finish_reason, error)

    def finish_if_whole(self) -> None:
        """Mark the record done once a noted end's positions are all here. Mutates."""
        if self._end is None or self.done.is_set():
            return
        end_pos, reason, error = self._end
        if set(range(end_pos)) <= set(self.indices):
            self.finish_reason, self.error = reason, error
            self.done.set()


@dataclass(frozen=True)
class ReceivedEvent:
    recv_s: float
    recv_wall_s: float
    event: StateEvent


class BenchBusClient:
    """Use as ``async with BenchBusClient(nats_url) as c``."""

    def __init__(
        self,
        nats_url: str,
        subject_prefix: str = "fluidpd",
        *,
        ttft_budget_s: float = 30.0,
        ack_timeout_s: float = 5.0,
    ) -> None:
        self.subjects = Subjects(subject_prefix)
        self.ttft_budget_s = ttft_budget_s
        self.ack_timeout_s = ack_timeout_s
        self.router_id = f"bench{uuid.uuid4().hex[:8]}"
        self.bus = Bus(BusConfig.from_url(nats_url, name=self.router_id), self.subjects)
        self.streams: dict[str, StreamRecord] = {}
        self.telemetry: dict[str, WorkerTelemetry] = {}
        self.events: list[ReceivedEvent] = []
        self.watcher: RegistryWatcher | None = None
        self._changed = asyncio.Event()

    async def __aenter__(self) -> BenchBusClient:
        await self.bus.start()
        s = self.subjects
        await self.bus.subscribe_stream(
            s.router_tokens_in(self.router_id), TokenBatch, self._on_batch
        )
        await self.bus.subscribe_stream(s.telemetry_all(), WorkerTelemetry, self._on_telemetry)
        await self.bus.subscribe_stream(s.events("*"), StateEvent, self._on_event)
        self.watcher = RegistryWatcher(self.bus)
        await self.watcher.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.watcher is not None:
            await self.watcher.stop()
        await self.bus.stop()

    # ----------------------------------------------------------------------- inbound
    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _on_batch(self, batch: TokenBatch) -> None:
        now, wall = time.perf_counter(), time.time()
        for item in batch.items:
            st = self.streams.get(item.request_id)
            if st is not None:  # P's prompt logprobs may come after D's last token
                for offset, plp in enumerate(item.prompt_logprobs):
                    st.prompt_logprobs.setdefault(item.prompt_logprobs_start + offset, plp)
            if st is None or st.done.is_set():
                continue
            if item.handed_to is not None and item.handed_role is not None:
                st.hand_overs.append(
                    (batch.publisher_id, item.handed_to, item.handed_role, len(st.token_ids))
                )
            for name, value in item.timestamps.items():
                st.timestamps.setdefault(name, value)
            for offset, tok in enumerate(item.token_ids):
                lp = item.logprobs[offset] if item.logprobs else None
                st.place(item.index + offset, tok, now, wall, batch.publisher_id, lp)
            if item.finish_reason is not None:
                st.end_at(item.index + len(item.token_ids), item.finish_reason, item.error)
            st.finish_if_whole()
        self._notify()

    async def _on_telemetry(self, msg: WorkerTelemetry) -> None:
        self.telemetry[msg.publisher_id] = msg
        self._notify()

    async def _on_event(self, msg: StateEvent) -> None:
        self.events.append(ReceivedEvent(time.perf_counter(), time.time(), msg))
        self._notify()

    # ---------------------------------------------------------------------- waiting
    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        """Return once ``predicate()`` holds (re-checked on every inbound message).
        Raises TimeoutError."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("condition not met in time")
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                continue

    async def wait_workers(self, ids: Sequence[str], timeout_s: float = 60.0) -> None:
        """Wait until every id is registered Active. Raises TimeoutError."""
        assert self.watcher is not None
        want = set(ids)
        await self.watcher.wait_until(
            lambda w: want <= {r.worker_id for r in w.workers(state=ACTIVE)}, timeout_s
        )

    async def wait_telemetry(
        self, predicate: Callable[[dict[str, WorkerTelemetry]], bool], timeout_s: float = 20.0
    ) -> None:
        """Return once ``predicate(self.telemetry)`` holds. Raises TimeoutError."""
        await self.wait_until(lambda: predicate(self.telemetry), timeout_s)

    @property
    def results(self) -> dict[str, StreamRecord]:
        """Every submitted request's record, by request id (live view)."""
        return self.streams

    async def result(self, rid: str, timeout_s: float = 60.0) -> StreamRecord:
        st = self.streams[rid]
        await asyncio.wait_for(st.done.wait(), timeout_s)
        return st

    # ---------------------------------------------------------------------- outbound
    async def submit(
        self,
        prefill_id: str,
        decode_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        seed: int = 1,
        temperature: float = 0.0,
        ignore_eos: bool = True,
        steal_ratio: float | None = None,
        ttft_budget_s: float | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> str:
        """Send one request to ``prefill_id`` paired with ``decode_id`` (greedy and
        ignore_eos unless told); ``steal_ratio`` forces a FluidToken split of that share.
        Raises BusError when the worker does not take it."""
        budget_s = self.ttft_budget_s if ttft_budget_s is None else ttft_budget_s
        rid = uuid.uuid4().hex[:12]
        now = time.time()
        msg = PrefillRequest(
            request_id=rid,
            router_id=self.router_id,
            prompt_token_ids=tuple(prompt),
            sampling=SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                seed=seed,
                ignore_eos=ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            ),
            decode_worker_id=decode_id,
            arrival_time_s=now,
            ttft_deadline_s=now + budget_s,
            tokens_subject=self.subjects.router_tokens(self.router_id),
            force_steal_ratio=steal_ratio,
        )
        self.streams[rid] = StreamRecord(rid, time.perf_counter(), now)
        await self.bus.request(
            self.subjects.worker_prefill(prefill_id), msg, Ack, self.ack_timeout_s
        )
        return rid

    async def cancel(self, rid: str, worker_ids: Sequence[str]) -> None:
        for wid in worker_ids:
            await self.bus.publish(self.subjects.worker_cancel(wid), CancelRequest(request_id=rid))

    async def status(self, timeout_s: float = 5.0) -> StatusReply:
        """The controller's cluster status. Raises BusError / TimeoutError."""
        return await self.bus.request(
            self.subjects.controller_status(), StatusRequest(), StatusReply, timeout_s
        )

    async def switch(self, worker_id: str, role: Role, timeout_s: float = 5.0) -> SwitchReply:
        return await self.bus.request(
            self.subjects.worker_switch(worker_id), SwitchCommand(role=role), SwitchReply, timeout_s
        )
