"""Serving one generation request over HTTP: submit, assemble text, answer (JSON or SSE).

Text: IncrementalDetokenizer (correct across multi-byte UTF-8) then StopMatcher (stop
strings; the stop string is not returned and ends the request early: the workers get a
CancelRequest). A client that disconnects cancels the handler (aiohttp
``handler_cancellation``) and the request is cancelled on the workers.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import structlog
from aiohttp import web

from services.router.admission import AdmissionGate
from services.router.dispatch import Dispatcher, InFlight
from services.router.errors import ApiError, error_body, error_type_for
from services.router.metrics import RouterMetrics
from services.router.openai_api import GenerationRequest
from services.router.streams import StreamEnd
from shared.stop_strings import StopMatcher
from shared.tokenizer import IncrementalDetokenizer, Tokenizer

log = structlog.get_logger("fluidpd.router")
SSE_DONE = b"data: [DONE]\n\n"


def end_to_error(end: StreamEnd) -> ApiError:
    """A failed stream end as an HTTP error (503 + Retry-After when capacity ran out)."""
    code = end.error_code or "worker_error"
    message = end.error or f"the request ended with {end.finish_reason}"
    if code == "request_timeout":
        return ApiError(message, code=code, http_status=504)
    retry = (
        1
        if code
        in (
            "kv_capacity_exhausted",
            "worker_lost",
            "router_stopping",
            "stream_gap",
            "bus_reconnected",
            "deadline_expired",
            "decode_wait_timeout",
        )
        else None
    )
    return ApiError(message, code=code, http_status=503, retry_after_s=retry)


class TextAssembler:
    """Token ids → emitted text for one request. Mutates its own state only."""

    def __init__(self, tokenizer: Tokenizer, req: GenerationRequest) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, list(req.prompt_token_ids))
        self._stops = StopMatcher(req.stop)
        self.num_tokens = 0
        self.receive_times_s: list[float] = []

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    def push(self, token_ids: list[int], receive_times_s: list[float]) -> str:
        out = []
        for token, recv in zip(token_ids, receive_times_s, strict=True):
            if self._stops.stopped:
                break
            self.num_tokens += 1
            self.receive_times_s.append(recv)
            out.append(self._stops.feed(self._detok.push(token)))
        return "".join(out)

    def finish(self) -> str:
        if self._stops.stopped:
            return ""
        return self._stops.feed(self._detok.flush()) + self._stops.flush()


class GenerationHandler:
    """Runs one request end to end. ``dispatcher`` submits/cancels; ``model_name`` goes in
    the responses."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        tokenizer: Tokenizer,
        model_name: str,
        metrics: RouterMetrics,
        request_timeout_s: float,
        *,
        gate: AdmissionGate | None = None,
        short_prompt_tokens: int = 0,
    ) -> None:
        self.gate = gate
        self.short_prompt_tokens = short_prompt_tokens
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s

    async def _next(self, entry: InFlight) -> Any:
        remaining = entry.arrival_s + self.request_timeout_s - time.time()
        try:
            async with asyncio.timeout(max(0.0, remaining)):
                return await entry.stream.next()
        except TimeoutError:
            entry.stream.fail(
                f"request timed out after {self.request_timeout_s:g} s", "request_timeout"
            )
            self.dispatcher.cancel_soon(entry, "request_timeout")
            return await entry.stream.next()

    def _base(self, req: GenerationRequest, entry: InFlight, chunk: bool) -> dict[str, Any]:
        if req.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
            prefix = "chatcmpl-"
        else:
            obj, prefix = "text_completion", "cmpl-"
        return {
            "id": prefix + entry.request_id,
            "object": obj,
            "created": int(entry.arrival_s),
            "model": self.model_name,
        }

    def _choice(
        self,
        req: GenerationRequest,
        text: str | None,
        finish: str | None,
        chunk: bool,
        first: bool = False,
    ) -> dict[str, Any]:
        if req.kind == "completion":
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if chunk:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {
            "index": 0,
            "message": {"role": "assistant", "content": text or ""},
            "logprobs": None,
            "finish_reason": finish,
        }

    @staticmethod
    def _usage(entry: InFlight, text: TextAssembler) -> dict[str, int]:
        return {
            "prompt_tokens": entry.prompt_len,
            "completion_tokens": text.num_tokens,
            "total_tokens": entry.prompt_len + text.num_tokens,
        }

    @staticmethod
    def _extension(entry: InFlight, text: TextAssembler) -> dict[str, Any]:
        return {
            "request_id": entry.request_id,
            "prefill_worker": entry.prefill_id,
            "decode_worker": entry.decode_id,
            "arrival_s": entry.arrival_s,
            "sent_s": entry.sent_s,
            "token_receive_s": text.receive_times_s,
            "worker_timestamps": entry.stream.timestamps,
        }

    async def run(
        self, request: web.Request, req: GenerationRequest, max_tokens: int
    ) -> web.StreamResponse:
        """Serve ``req``. Raises ApiError (before any byte is sent) on failure: also
        Overloaded (503 + Retry-After) when the admission gate sheds it."""
        prompt_len = len(req.prompt_token_ids)
        gated = self.gate is not None and prompt_len > self.short_prompt_tokens
        if gated:
            assert self.gate is not None
            self.gate.check(prompt_len)  # before anything is sent or computed
        entry = await self.dispatcher.submit(req, max_tokens)
        if gated:
            assert self.gate is not None
            self.gate.note_sent(entry.prefill_id, prompt_len)
        self.metrics.in_flight.inc()
        self.metrics.prompt_tokens_total.inc(entry.prompt_len)
        text = TextAssembler(self.tokenizer, req)
        ended = False
        try:
            if req.stream:
                response = await self._stream(request, req, entry, text)
            else:
                response = await self._whole(req, entry, text)
            ended = True
            return response
        finally:
            if text.stopped or not entry.stream.finished:
                reason = "stop_string" if text.stopped else "client_disconnected"
                self.dispatcher.cancel_soon(entry, reason)
            self.dispatcher.release(entry)
            self.metrics.in_flight.dec()
            self.metrics.completion_tokens_total.inc(text.num_tokens)
            self.metrics.observe_tokens(entry.arrival_s, text.receive_times_s)
            log.info(
                "request_done",
                request_id=entry.request_id,
                ended=ended,
                prompt_tokens=entry.prompt_len,
                completion_tokens=text.num_tokens,
            )

    async def _collect(
        self, entry: InFlight, text: TextAssembler
    ) -> tuple[list[str], StreamEnd | None]:
        """One step: new text pieces and the end (None while running)."""
        chunk = await self._next(entry)
        pieces = [text.push(chunk.token_ids, chunk.receive_times_s)]
        if text.stopped:
            return pieces, StreamEnd("stop")
        if chunk.end is not None and not chunk.end.failed:
            pieces.append(text.finish())
        return pieces, chunk.end

    async def _whole(
        self, req: GenerationRequest, entry: InFlight, text: TextAssembler
    ) -> web.Response:
        parts: list[str] = []
        while True:
            pieces, end = await self._collect(entry, text)
            parts.extend(pieces)
            if end is not None:
                break
        if end.failed:
            raise end_to_error(end)
        body = {
            **self._base(req, entry, chunk=False),
            "choices": [self._choice(req, "".join(parts), end.finish_reason, chunk=False)],
            "usage": self._usage(entry, text),
        }
        if req.timestamps:
            body["fluidpd"] = self._extension(entry, text)
        return web.json_response(body)

    async def _stream(
        self, request: web.Request, req: GenerationRequest, entry: InFlight, text: TextAssembler
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        base = self._base(req, entry, chunk=True)
        usage_null = {"usage": None} if req.include_usage else {}

        async def send(payload: dict[str, Any]) -> None:
            await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

        if req.kind == "chat":
            await send(
                {**base, "choices": [self._choice(req, "", None, True, first=True)], **usage_null}
            )
        while True:
            pieces, end = await self._collect(entry, text)
            delta = "".join(pieces)
            if end is not None and end.failed:
                if delta:
                    await send(
                        {**base, "choices": [self._choice(req, delta, None, True)], **usage_null}
                    )
                err = end_to_error(end)
                await send(error_body(err.message, error_type_for(err.http_status), err.code))
                break
            if delta or end is not None:
                finish = end.finish_reason if end is not None else None
                payload = {
                    **base,
                    "choices": [self._choice(req, delta, finish, True)],
                    **usage_null,
                }
                if end is not None and req.timestamps:
                    payload["fluidpd"] = self._extension(entry, text)
                await send(payload)
            if end is not None:
                if req.include_usage:
                    await send({**base, "choices": [], "usage": self._usage(entry, text)})
                break
        await response.write(SSE_DONE)
        await response.write_eof()
        return response
