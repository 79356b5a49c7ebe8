"""The one wrapper that every bus handler and stream callback runs inside.

Request handlers: decode (msgpack, or JSON where the type accepts it) → call → encode the
reply in the encoding of the request → publish it. Nothing escapes: an invalid payload,
a typed error or an unexpected exception becomes an ErrorReply (or, without a reply
subject, a log line and a counted outcome), so one bad message never ends a subscription
and invalid input never reaches (or changes the state of) the handler.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import structlog

from shared.bus.metrics import BusMetrics
from shared.errors import FluidPDError
from shared.messages import (
    Ack,
    ErrorReply,
    Message,
    MessageError,
    SequenceTracker,
    StreamMessage,
    decode_with_format,
    encode,
    is_json,
)
from shared.messages.common import MAX_ERROR_CHARS
from shared.messages.schema import truncate_text

Req = TypeVar("Req", bound=Message)
S = TypeVar("S", bound=StreamMessage)
Handler = Callable[[Req], Awaitable[Message | None]]
Reply = Callable[[str, bytes], Awaitable[None]]

log = structlog.get_logger("fluidpd.bus")


def error_reply_for(exc: BaseException) -> tuple[ErrorReply, str]:
    """The ErrorReply for an exception and the metrics outcome. Pure."""
    if isinstance(exc, MessageError):
        return ErrorReply(code=exc.code, error=truncate_text(str(exc), MAX_ERROR_CHARS)), "invalid"
    if isinstance(exc, FluidPDError):
        retry_after_ms = getattr(exc, "retry_after_ms", None)
        if not isinstance(retry_after_ms, int) or isinstance(retry_after_ms, bool):
            retry_after_ms = None
        reply = ErrorReply(
            code=truncate_text(str(exc.code), 64),
            error=truncate_text(str(exc), MAX_ERROR_CHARS),
            retry_after_ms=retry_after_ms,
        )
        return reply, "error"
    return ErrorReply(code="internal_error", error=f"internal error ({type(exc).__name__})"), (
        "internal_error"
    )


def _encode_reply(reply: Message, json_mode: bool) -> bytes:
    try:
        return encode(reply, json_mode=json_mode)
    except MessageError as exc:  # the handler built an invalid/oversized reply: our bug
        log.error("bus.reply_invalid", reply_type=reply.TYPE_TAG, error=str(exc)[:200])
        fallback = ErrorReply(code="internal_error", error="handler produced an invalid reply")
        return encode(fallback, json_mode=json_mode)


async def handle_request(
    *,
    data: bytes,
    reply_subject: str | None,
    label: str,
    request_type: type[Req],
    handler: Handler[Req],
    send: Reply,
    metrics: BusMetrics,
) -> None:
    """Run one request through ``handler`` and answer it. Never raises (except cancel)."""
    start_s = time.perf_counter()
    json_mode = is_json(data)
    reply: Message | None
    try:
        request, json_mode = decode_with_format(data, request_type)
        reply = await handler(request)
        if reply is None:
            reply = Ack()
        outcome = "ok"
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        reply, outcome = error_reply_for(exc)
        if outcome == "internal_error":
            log.exception("bus.handler_crashed", subject=label, request_type=request_type.TYPE_TAG)
        else:
            log.info("bus.request_rejected", subject=label, code=reply.code, outcome=outcome)
    try:
        if reply_subject:
            await send(reply_subject, _encode_reply(reply, json_mode))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # connection trouble while replying: the requester times out
        log.warning("bus.reply_failed", subject=label, error=type(exc).__name__)
        outcome = "reply_failed"
    metrics.handled_total.labels(subject=label, outcome=outcome).inc()
    metrics.handler_seconds.labels(subject=label).observe(time.perf_counter() - start_s)


async def handle_stream(
    *,
    data: bytes,
    label: str,
    msg_type: type[S],
    callback: Callable[[S], Awaitable[None]],
    tracker: SequenceTracker,
    on_gap: Callable[[str, int], Any] | None,
    metrics: BusMetrics,
    subject_publisher: str | None = None,
) -> None:
    """Decode one stream message, apply the sequence tracker, call ``callback``.

    ``subject_publisher``: the worker id the subject names (``Subjects.publisher_of``);
    NATS permissions let only that worker publish there, so a message claiming another
    ``publisher_id`` is forged and dropped before it can touch the tracker.
    Invalid, forged and duplicate messages are counted and dropped. Never raises (except
    cancel).
    """
    start_s = time.perf_counter()
    try:
        msg = decode_with_format(data, msg_type)[0]
        forged = subject_publisher is not None and msg.publisher_id != subject_publisher
        seen = None if forged else tracker.observe(msg.publisher_id, msg.epoch, msg.seq)
        if seen is None:
            outcome = "forged"
            log.warning("bus.stream_forged_publisher", subject=label, publisher=subject_publisher)
        elif not seen.accepted:
            outcome = "duplicate"
        else:
            if seen.gap:
                metrics.stream_gap_messages_total.labels(subject=label).inc(seen.gap)
                log.warning(
                    "bus.stream_gap", subject=label, publisher=msg.publisher_id, missing=seen.gap
                )
                if on_gap is not None:
                    on_gap(msg.publisher_id, seen.gap)
            await callback(msg)
            outcome = "ok"
    except asyncio.CancelledError:
        raise
    except MessageError as exc:
        outcome = "invalid"
        log.info("bus.stream_invalid", subject=label, error=str(exc)[:200])
    except Exception:
        outcome = "internal_error"
        log.exception("bus.stream_callback_crashed", subject=label)
    metrics.handled_total.labels(subject=label, outcome=outcome).inc()
    metrics.handler_seconds.labels(subject=label).observe(time.perf_counter() - start_s)
