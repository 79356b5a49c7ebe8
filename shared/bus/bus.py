"""A thin typed wrapper around nats-py: connect, publish, request, serve, stream subscribe.

Usage::

    async with Bus(BusConfig.from_url(url), Subjects(), registry=prom_registry) as bus:
        await bus.serve(subjects.worker_switch("w3"), SwitchCommand, on_switch)
        reply = await bus.request(subject, msg, SwitchReply, timeout_s=1.0)

Reconnects forever once connected; ``add_reconnect_listener`` lets the registry re-put
and re-watch after a server restart. ``stop()`` drains and is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry

from shared.bus.config import BusConfig
from shared.bus.connect import client_options, connect_first, is_auth_refusal
from shared.bus.errors import (
    BusConnectionError,
    BusNoRespondersError,
    BusTimeoutError,
    RemoteError,
)
from shared.bus.handler import Handler, handle_request, handle_stream
from shared.bus.metrics import BusMetrics
from shared.bus.serve_handle import ServeHandle
from shared.messages import (
    MAX_MESSAGE_BYTES,
    ErrorReply,
    Message,
    SequenceTracker,
    StreamMessage,
    Subjects,
    decode_reply,
    encode,
)

R = TypeVar("R", bound=Message)
Req = TypeVar("Req", bound=Message)
S = TypeVar("S", bound=StreamMessage)
ReconnectListener = Callable[[], Awaitable[None]]

log = structlog.get_logger("fluidpd.bus")


class Bus:
    """Typed NATS client. Not thread-safe; one event loop."""

    def __init__(
        self,
        config: BusConfig,
        subjects: Subjects,
        *,
        registry: CollectorRegistry | None = None,
        metrics: BusMetrics | None = None,
    ) -> None:
        """``metrics`` (shared) or ``registry`` (metrics created in it) or neither (a
        private registry: never the global one)."""
        self.config = config
        self.subjects = subjects
        self.metrics = metrics or BusMetrics.create(registry or CollectorRegistry())
        self._nc: Client | None = None
        self._listeners: list[ReconnectListener] = []
        self._handles: list[ServeHandle] = []
        self._bg_tasks: set[asyncio.Task[None]] = set()
        self._stopped = False
        self.max_message_bytes = MAX_MESSAGE_BYTES

    # --- lifecycle ----------------------------------------------------------------------
    async def __aenter__(self) -> Bus:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Connect (retrying until ``initial_connect_deadline_s``; None: forever).

        Raises BusConnectionError when the deadline passes (bad address, bad credentials).
        """
        cfg = self.config
        options = client_options(
            cfg,
            reconnected_cb=self._on_reconnected,
            disconnected_cb=self._on_disconnected,
            error_cb=self._on_error,
        )
        self._refused = asyncio.get_running_loop().create_future()
        self._nc = await connect_first(cfg, options, self._refused)
        server_max = self._nc.max_payload
        if server_max and server_max < self.max_message_bytes:
            log.warning("bus.small_max_payload", max_payload_bytes=server_max)
            self.max_message_bytes = server_max
        self.metrics.connected.set(1)
        log.info("bus.connected", name=cfg.name, max_payload_bytes=server_max)

    async def stop(self) -> None:
        """Unsubscribe everything, drain pending messages and close. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        for handle in list(self._handles):
            await handle.stop()
        nc, self._nc = self._nc, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(TimeoutError, nats.errors.Error, OSError):
                await asyncio.wait_for(nc.drain(), self.config.drain_timeout_s)
            if not nc.is_closed:
                await nc.close()
        for task in list(self._bg_tasks):
            task.cancel()

    @property
    def nc(self) -> Client:
        """The underlying nats-py client. Raises BusConnectionError when not started."""
        if self._nc is None or self._nc.is_closed:
            raise BusConnectionError("bus is not connected")
        return self._nc

    @property
    def is_connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    def jetstream(self, timeout_s: float = 5.0) -> JetStreamContext:
        """A JetStream context on this connection."""
        return self.nc.jetstream(timeout=timeout_s)

    def add_reconnect_listener(self, listener: ReconnectListener) -> None:
        """Call ``listener()`` (as a task) after every reconnect. Mutates the bus."""
        self._listeners.append(listener)

    def remove_reconnect_listener(self, listener: ReconnectListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        """Run ``coro`` as a task owned by the bus (cancelled on stop)."""
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._bg_tasks.add(task)
        task.add_done_callback(self._bg_tasks.discard)
        return task

    async def _on_reconnected(self) -> None:
        self.metrics.connected.set(1)
        log.info("bus.reconnected")
        for listener in list(self._listeners):
            self.spawn(listener())

    async def _on_disconnected(self) -> None:
        self.metrics.connected.set(0)
        if not self._stopped:
            self.metrics.disconnects_total.inc()
            log.warning("bus.disconnected")

    async def _on_error(self, exc: Exception) -> None:
        text = str(exc) or type(exc).__name__
        log.info("bus.connection_error", error=type(exc).__name__, detail=text[:200])
        refused = getattr(self, "_refused", None)
        # Bad credentials will not get better by retrying: fail the first connect at once.
        if refused is not None and not refused.done() and self._nc is None and is_auth_refusal(exc):
            refused.set_result(text[:200])

    # --- sending --------------------------------------------------------------------------
    def _encode(self, msg: Message) -> bytes:
        return encode(msg, max_bytes=self.max_message_bytes)

    async def publish(self, subject: str, msg: Message) -> None:
        """Publish ``msg`` (msgpack). Raises MessageError/MessageTooLargeError before
        sending anything, BusConnectionError when closed. Buffered while reconnecting."""
        data = self._encode(msg)
        try:
            await self.nc.publish(subject, data)
        except nats.errors.ConnectionClosedError:
            raise BusConnectionError("bus is closed") from None

    async def request(
        self, subject: str, msg: Message, reply_type: type[R], timeout_s: float | None = None
    ) -> R:
        """Send ``msg`` and return the typed reply.

        Raises BusTimeoutError, BusNoRespondersError, BusConnectionError, RemoteError (the
        responder sent an ErrorReply) or MessageError (invalid request or reply).
        """
        data = self._encode(msg)
        timeout = self.config.request_timeout_s if timeout_s is None else timeout_s
        label = self.subjects.pattern(subject)
        start_s = time.perf_counter()
        outcome = "ok"
        try:
            reply_msg = await self.nc.request(subject, data, timeout=timeout)
            reply = decode_reply(reply_msg.data, reply_type)
            if isinstance(reply, ErrorReply):
                outcome = "remote_error"
                raise RemoteError(reply.code, reply.error, reply.retry_after_ms)
            return reply
        except nats.errors.NoRespondersError:
            outcome = "no_responders"
            raise BusNoRespondersError(f"no responders on {label}") from None
        except (TimeoutError, nats.errors.TimeoutError):
            outcome = "timeout"
            raise BusTimeoutError(f"no reply on {label} within {timeout:.3f} s") from None
        except nats.errors.ConnectionClosedError:
            outcome = "closed"
            raise BusConnectionError("bus is closed") from None
        finally:
            self.metrics.requests_total.labels(subject=label, outcome=outcome).inc()
            self.metrics.request_seconds.labels(subject=label).observe(
                time.perf_counter() - start_s
            )

    async def flush(self, timeout_s: float = 2.0) -> None:
        """Wait until the server has processed everything sent so far."""
        await self.nc.flush(timeout=math.ceil(timeout_s))

    # --- receiving ------------------------------------------------------------------------
    async def serve(
        self,
        subject: str,
        request_type: type[Req],
        handler: Handler[Req],
        *,
        queue: str | None = None,
        max_concurrency: int = 1,
    ) -> ServeHandle:
        """Serve requests (or publishes) on ``subject`` with ``handler``.

        Every message goes through shared.bus.handler.handle_request (decode, metrics,
        error replies, reply in the request's encoding). ``handler`` returns the reply
        message (None → Ack). With ``max_concurrency`` > 1 up to that many calls run at
        once (in order of arrival); otherwise one at a time.
        """
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        nc = self.nc
        label = self.subjects.pattern(subject)
        tasks: set[asyncio.Task[None]] = set()
        slots = asyncio.Semaphore(max_concurrency)

        async def send(reply_subject: str, payload: bytes) -> None:
            await nc.publish(reply_subject, payload)

        def run(msg: Msg) -> Awaitable[None]:
            return handle_request(
                data=msg.data,
                reply_subject=msg.reply or None,
                label=label,
                request_type=request_type,
                handler=handler,
                send=send,
                metrics=self.metrics,
            )

        async def on_message(msg: Msg) -> None:
            if max_concurrency == 1:
                await run(msg)
                return
            await slots.acquire()
            task = asyncio.ensure_future(run(msg))
            tasks.add(task)

            def done(t: asyncio.Task[None]) -> None:
                tasks.discard(t)
                slots.release()

            task.add_done_callback(done)

        sub = await nc.subscribe(subject, queue=queue or "", cb=on_message)
        return ServeHandle(sub, tasks, owned_by=self._handles)

    async def subscribe_stream(
        self,
        subject: str,
        msg_type: type[S],
        callback: Callable[[S], Awaitable[None]],
        *,
        on_gap: Callable[[str, int], Any] | None = None,
        tracker: SequenceTracker | None = None,
    ) -> ServeHandle:
        """Subscribe to a stream subject (may be a wildcard); ``callback`` gets each new
        message once, in publisher order. Duplicates/stale messages are dropped, gaps are
        counted and reported to ``on_gap(publisher_id, missing)``. A tracker may be passed
        in to share or inspect it."""
        nc = self.nc
        label = self.subjects.pattern(subject)
        seq_tracker = tracker or SequenceTracker()

        async def on_message(msg: Msg) -> None:
            await handle_stream(
                data=msg.data,
                label=label,
                msg_type=msg_type,
                callback=callback,
                tracker=seq_tracker,
                on_gap=on_gap,
                metrics=self.metrics,
                subject_publisher=self.subjects.publisher_of(msg.subject),
            )

        sub = await nc.subscribe(subject, cb=on_message)
        return ServeHandle(sub, set(), owned_by=self._handles)
