"""The bus side of the router: submit requests to a worker pair, route token items to
their streams, cancel, and end requests whose worker left the registry.

Holds request → (prefill worker, decode worker, stream) for every request in flight; an
entry and its custody rules are in_flight.py.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import Callable

import structlog

from services.router.config import RouterConfig
from services.router.errors import Unavailable
from services.router.in_flight import InFlight
from services.router.metrics import RouterMetrics
from services.router.openai_api import GenerationRequest
from services.router.pairing import NoWorkerError, PairingPolicy
from services.router.streams import RequestStream
from shared.bus import Bus, BusError, RemoteError
from shared.bus.registry_watcher import RegistryChange
from shared.messages import (
    Ack,
    CancelRequest,
    PrefillRequest,
    Subjects,
    TokenBatch,
    WorkerRecord,
)
from shared.policy.roles import DECODE, PREFILL, Role

log = structlog.get_logger("fluidpd.router")
SEED_BITS = 62
RETRY_AFTER_S = 1


class Dispatcher:
    """Owns the in-flight table. Event loop only. ``workers(role)`` returns the active
    records of a role (from the RegistryWatcher)."""

    def __init__(
        self,
        cfg: RouterConfig,
        bus: Bus,
        subjects: Subjects,
        workers: Callable[[Role], list[WorkerRecord]],
        policy: PairingPolicy,
        metrics: RouterMetrics,
    ) -> None:
        self.cfg = cfg
        self.bus = bus
        self.subjects = subjects
        self.tokens_subject = subjects.router_tokens(cfg.id)
        self._workers = workers
        self.policy = policy
        self.metrics = metrics
        self.in_flight: dict[str, InFlight] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    # --- bus callbacks ----------------------------------------------------------------
    async def on_tokens(self, batch: TokenBatch) -> None:
        """Route each item to its stream; items of unknown/finished requests, and items
        from a worker that does not serve the request (``InFlight.may_publish``), are dropped."""
        now = time.time()
        foreign = 0
        for item in batch.items:
            entry = self.in_flight.get(item.request_id)
            if entry is not None:
                if not entry.may_publish(batch.publisher_id):
                    foreign += 1
                    continue
                if item.handed_to is not None and item.handed_role is not None:
                    # TokenItem.check: a hand-over always names the role handed over.
                    entry.hand_over(batch.publisher_id, item.handed_to, item.handed_role)
                    continue
                entry.streamed_by(batch.publisher_id)
                if item.token_ids or item.finish_reason is not None:
                    # Admitted and running (or over): the decode worker's telemetry now
                    # counts it, so the pairing stops counting it as in flight to it.
                    self.policy.settle(item.request_id)
                entry.stream.offer(item, now)
        if foreign:  # one line per batch: a flood of forged items must not flood the log
            self.metrics.foreign_token_items_total.inc(foreign)
            log.warning("token_items_foreign", publisher=batch.publisher_id, items=foreign)

    def on_registry_change(self, change: RegistryChange) -> None:
        """A worker left: end the requests it still holds (``InFlight.held_by``: also a
        request it was moving to a peer, whose outcome only it could settle)."""
        if change.kind != "removed":
            return
        forget = getattr(self.policy, "forget", None)
        if forget is not None:
            forget(change.worker_id)
        for entry in list(self.in_flight.values()):
            if entry.held_by(change.worker_id) and not entry.stream.finished:
                log.warning(
                    "request_worker_lost",
                    request_id=entry.request_id,
                    worker=change.worker_id,
                    reason=change.reason,
                )
                entry.stream.fail(
                    f"worker {change.worker_id} left the cluster "
                    f"({change.reason}) while serving this request",
                    "worker_lost",
                )
                self.cancel_soon(entry, "worker_lost")

    def on_stream_gap(self, publisher_id: str, missing: int) -> None:
        """Token batches from ``publisher_id`` were lost: its streams cannot be trusted."""
        self._fail_held(
            lambda e: e.held_by(publisher_id),
            f"{missing} token message(s) from worker {publisher_id} were lost on the bus",
            "stream_gap",
        )

    async def on_bus_reconnected(self) -> None:
        """After a NATS outage any in-flight stream may have lost tokens: end them clearly
        (retryable) instead of letting them wait for tokens that will never come."""
        self._fail_held(lambda e: True, "the message bus reconnected mid-stream", "bus_reconnected")

    def _fail_held(self, holds: Callable[[InFlight], bool], error: str, code: str) -> None:
        for entry in list(self.in_flight.values()):
            if holds(entry) and not entry.stream.finished:
                log.warning("request_stream_failed", request_id=entry.request_id, code=code)
                entry.stream.fail(error, code)
                self.cancel_soon(entry, code)

    # --- submission -------------------------------------------------------------------
    def _pick(
        self, exclude: frozenset[str], request_id: str, prompt_tokens: int, max_tokens: int
    ) -> tuple[str, str]:
        try:
            return self.policy.choose(
                self._workers(PREFILL),
                self._workers(DECODE),
                exclude,
                prompt_tokens=prompt_tokens,
                max_tokens=max_tokens,
                request_id=request_id,
            )
        except NoWorkerError as exc:
            raise Unavailable(
                f"{exc}; retry later", code="no_active_workers", retry_after_s=RETRY_AFTER_S
            ) from None

    async def submit(
        self,
        req: GenerationRequest,
        max_tokens: int,
        *,
        sample_logprobs: bool = False,
        admit: Callable[[str], None] | None = None,
    ) -> InFlight:
        """Send the request to a pair (retrying once on another pair); ``sample_logprobs``:
        the sampled tokens' logprobs come back even when ``req`` asks for none (the router
        ranks best_of samples by them; no prompt logprobs are computed for it). ``admit``:
        the door check, called with the first pair's prefill worker before anything is sent
        or registered; what it raises (Overloaded) propagates with the pairing withdrawn. A
        retry is not checked again: the request was admitted. Returns the in-flight entry
        (the caller must ``release`` it). Raises Unavailable (503). Cancelled meanwhile
        (client gone): the entry is released and the request cancelled on both workers
        before CancelledError propagates."""
        request_id = uuid.uuid4().hex
        arrival_s = time.time()
        seed = req.seed if req.seed is not None else secrets.randbits(SEED_BITS)
        sampling = req.sampling(max_tokens, seed, sample_logprobs=sample_logprobs)
        echo_logprobs = req.echo and req.logprobs is not None
        short = 0 < len(req.prompt_token_ids) <= self.cfg.short_prompt_tokens
        exclude: frozenset[str] = frozenset()
        last_error: Exception | None = None
        for attempt in range(2):
            prefill_id, decode_id = self._pick(
                exclude, request_id, len(req.prompt_token_ids), max_tokens
            )
            if admit is not None and attempt == 0:
                try:
                    admit(prefill_id)
                except Exception:
                    self.policy.withdraw(request_id)  # never sent: counted nowhere
                    raise
            target = decode_id if short else prefill_id
            msg = PrefillRequest(
                request_id=request_id,
                router_id=self.cfg.id,
                prompt_token_ids=req.prompt_token_ids,
                sampling=sampling,
                decode_worker_id=decode_id,
                arrival_time_s=arrival_s,
                ttft_deadline_s=arrival_s + self.cfg.ttft_slo_ms / 1000.0,
                tokens_subject=self.tokens_subject,
            )
            entry = InFlight(
                request_id,
                decode_id if short else prefill_id,
                decode_id,
                RequestStream(request_id, len(req.prompt_token_ids) if echo_logprobs else 0),
                arrival_s,
                len(req.prompt_token_ids),
                max_tokens,
            )
            # Registered before sending: the first token may beat the Ack.
            self.in_flight[request_id] = entry
            entry.sent_s = time.time()
            try:
                await self.bus.request(
                    self.subjects.worker_prefill(target),
                    msg,
                    Ack,
                    timeout_s=self.cfg.submit_timeout_s,
                )
            except asyncio.CancelledError:
                # The client went away (aiohttp cancels the handler) while the request was
                # on its way: the worker may already hold it. Forget it here and cancel it
                # on both workers, or it is computed in full for nobody.
                self.release(entry)
                self.cancel_soon(entry, "client_disconnected")
                raise
            except (RemoteError, BusError) as exc:
                self.in_flight.pop(request_id, None)
                last_error = exc
                log.warning(
                    "submit_failed",
                    request_id=request_id,
                    worker=target,
                    attempt=attempt,
                    error=type(exc).__name__,
                    code=getattr(exc, "code", ""),
                )
                exclude = exclude | {prefill_id, decode_id}
                if attempt == 0:
                    self.metrics.submit_retries_total.inc()
                continue
            log.info(
                "request_submitted",
                request_id=request_id,
                prefill=entry.prefill_id,
                decode=decode_id,
                prompt_tokens=len(req.prompt_token_ids),
                max_tokens=max_tokens,
                short=short,
            )
            return entry
        retry_s = RETRY_AFTER_S
        if isinstance(last_error, RemoteError) and last_error.retry_after_ms:
            retry_s = max(1, -(-last_error.retry_after_ms // 1000))
        raise Unavailable(
            f"no worker accepted the request ({getattr(last_error, 'code', '')}); retry later",
            code="no_worker_accepted",
            retry_after_s=retry_s,
        )

    # --- ending -----------------------------------------------------------------------
    async def cancel(self, entry: InFlight, reason: str) -> None:
        """Tell both workers to drop the request, and the decode worker a pending live
        migration comes from (it still holds the request and would resume it) (publish;
        unknown ids are ignored)."""
        if entry.cancelled:
            return
        entry.cancelled = True
        msg = CancelRequest(request_id=entry.request_id, reason=reason[:256])
        holders = (entry.prefill_id, entry.decode_id, entry.moving_from)
        for worker_id in dict.fromkeys(w for w in holders if w):
            try:
                await self.bus.publish(self.subjects.worker_cancel(worker_id), msg)
            except BusError as exc:
                log.warning(
                    "cancel_publish_failed",
                    request_id=entry.request_id,
                    worker=worker_id,
                    error=type(exc).__name__,
                )
        log.info("request_cancelled", request_id=entry.request_id, reason=reason)

    def cancel_soon(self, entry: InFlight, reason: str) -> None:
        """``cancel`` as a background task (safe from callbacks and cancelled handlers)."""
        if entry.cancelled:
            return
        task = asyncio.ensure_future(self.cancel(entry, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def release(self, entry: InFlight) -> None:
        """Forget the request; later items for it are dropped."""
        self.in_flight.pop(entry.request_id, None)
        self.policy.settle(entry.request_id)

    async def stop(self) -> None:
        """End every request (router shutting down) and wait for pending cancels."""
        for entry in list(self.in_flight.values()):
            entry.stream.fail("the router is shutting down", "router_stopping")
            self.cancel_soon(entry, "router_stopping")
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
