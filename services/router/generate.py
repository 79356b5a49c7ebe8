"""Serving one generation request over HTTP: submit, assemble text, answer (JSON or SSE).

Each choice's text and logprobs are assembled by services/router/choice.py, the response
objects built by services/router/response_body.py; a stop string ends a choice early (its
workers get a CancelRequest). ``n > 1`` (streamed or not): n requests to the workers,
sampled with seeds derived from the request's (``choice_seed``), so a seeded request gives
the same n choices every time. A client that disconnects cancels the handler (aiohttp
``handler_cancellation``) and the requests are cancelled on the workers.
A stream's 200 waits for its first token (bounded by ``stream_header_hold_s``), so a request
dropped before then gets an error status, not an in-band error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import secrets
import time
from typing import Any

import structlog
from aiohttp import web

from services.router.admission import AdmissionGate
from services.router.choice import Choice
from services.router.disconnect import wait_watching
from services.router.dispatch import Dispatcher
from services.router.errors import end_to_error, error_body, error_type_for
from services.router.in_flight import InFlight
from services.router.metrics import RouterMetrics
from services.router.openai_api import GenerationRequest
from services.router.response_body import choice_object, envelope, timing_extension, usage
from services.router.streams import StreamEnd
from shared.tokenizer import Tokenizer

log = structlog.get_logger("fluidpd.router")
SSE_DONE = b"data: [DONE]\n\n"
Step = tuple[Choice, str, StreamEnd | None]  # a choice, its new text, its end (or None)
SEED_BITS = 62
_SEED_MIX = 0x9E3779B97F4A7C15


def choice_seed(seed: int, index: int) -> int:
    """The sampling seed of choice ``index`` of a request seeded ``seed`` (choice 0 keeps
    it, so n=1 samples as before). Pure."""
    if index == 0:
        return seed
    return (seed ^ (index * _SEED_MIX)) & ((1 << SEED_BITS) - 1)


class GenerationHandler:
    """Runs one request end to end. ``dispatcher`` submits/cancels; ``model_name`` goes in
    the responses; ``stream_header_hold_s`` bounds how long a stream's 200 waits for its
    first token (0: headers at once)."""

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
        stream_header_hold_s: float = 0.0,
    ) -> None:
        self.gate = gate
        self.stream_header_hold_s = stream_header_hold_s
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

    async def run(
        self, request: web.Request, req: GenerationRequest, max_tokens: int
    ) -> web.StreamResponse:
        """Serve ``req``. Raises ApiError (before any byte is sent) on failure: also
        Overloaded (503 + Retry-After) when the admission gate sheds it."""
        prompt_len = len(req.prompt_token_ids)
        gate = self.gate if prompt_len > self.short_prompt_tokens else None
        seed = req.seed if req.seed is not None else secrets.randbits(SEED_BITS)
        if req.best_of > 1:
            req = dataclasses.replace(req, seed=seed)
        # best_of > n ranks the samples by cumulative logprob: the workers send the sampled
        # tokens' logprobs even when the client did not ask for any (nothing else changes).
        ranked = req.best_of > req.n and req.logprobs is None
        choices: list[Choice] = []
        try:
            for i in range(req.best_of):
                sub = dataclasses.replace(req, seed=choice_seed(seed, i)) if i else req
                # One door decision per HTTP request, on the prefill worker its first
                # sub-request is paired with, before anything is sent (admission.py).
                admit = functools.partial(gate.check, prompt_len) if gate and i == 0 else None
                entry = await self.dispatcher.submit(
                    sub, max_tokens, sample_logprobs=ranked, admit=admit
                )
                if gate is not None:
                    gate.note_sent(entry.prefill_id, prompt_len)
                choices.append(Choice(self.tokenizer, req, entry, i))
                self.metrics.in_flight.inc()
                self.metrics.prompt_tokens_total.inc(entry.prompt_len)
                self.metrics.vllm.submitted()
            if req.stream:
                return await self._stream(request, req, choices)
            return await self._whole(request, req, choices)
        finally:
            for choice in choices:
                self._end(choice)

    def _end(self, choice: Choice) -> None:
        entry, text = choice.entry, choice.text
        if text.stopped or not entry.stream.finished:
            reason = "stop_string" if text.stopped else "client_disconnected"
            self.dispatcher.cancel_soon(entry, reason)
        self.dispatcher.release(entry)
        self.metrics.in_flight.dec()
        self.metrics.completion_tokens_total.inc(text.num_tokens)
        self.metrics.observe_tokens(entry.arrival_s, text.receive_times_s)
        self.metrics.vllm.finished(
            entry.arrival_s,
            time.time(),
            text.receive_times_s,
            entry.prompt_len,
            choice.finish_reason,
        )
        log.info(
            "request_done",
            request_id=entry.request_id,
            finished=entry.stream.finished,
            prompt_tokens=entry.prompt_len,
            completion_tokens=text.num_tokens,
        )

    async def _collect(self, choice: Choice) -> tuple[list[str], StreamEnd | None]:
        """One step: new text pieces and the end (None while running)."""
        chunk = await self._next(choice.entry)
        before = choice.text.num_tokens
        pieces = choice.feed(chunk)
        if before == 0 and choice.text.num_tokens:
            self.metrics.vllm.first_token()
        end = StreamEnd("stop") if choice.text.stopped else chunk.end
        if end is not None:
            choice.finish_reason = end.finish_reason
        if chunk.end is not None and not chunk.end.failed and not choice.text.stopped:
            pieces.append(choice.text.finish())
        return pieces, end

    async def _gather(self, choice: Choice) -> tuple[str, StreamEnd]:
        parts: list[str] = []
        while True:
            pieces, end = await self._collect(choice)
            parts.extend(pieces)
            if end is not None:
                return "".join(parts), end

    async def _whole(
        self, request: web.Request, req: GenerationRequest, choices: list[Choice]
    ) -> web.Response:
        # Nothing is written until the end: watch the connection as a stream's hold does.
        results = await wait_watching(request, asyncio.gather(*(self._gather(c) for c in choices)))
        for _, end in results:
            if end.failed:
                raise end_to_error(end)
        entry = choices[0].entry
        done = list(zip(choices, results, strict=True))
        if req.best_of > req.n:  # the n most likely samples, most likely first (as vLLM)
            done = sorted(done, key=lambda d: -d[0].cumulative_logprob)[: req.n]
            for i, (c, _) in enumerate(done):
                c.index = i
        body = {
            **envelope(req, entry, self.model_name, chunk=False),
            "choices": [
                choice_object(req, c, text, end.finish_reason, chunk=False)
                for c, (text, end) in done
            ],
            "usage": usage(choices),
        }
        if req.timestamps:
            body["fluidpd"] = timing_extension(entry, choices[0].text)
        return web.json_response(body)

    async def _hold(
        self, request: web.Request, steps: asyncio.Queue[Step], choices: list[Choice]
    ) -> Step | None:
        """Wait for the first step of any choice (a token or an end), at most
        ``stream_header_hold_s`` after the request's arrival; None when the hold ran out
        first. Raises ApiError (a 503 + Retry-After for deadline expiry or lost capacity)
        when the request ended before anything was produced for it. A client that leaves
        meanwhile cancels the handler (aiohttp ``handler_cancellation`` fires before the
        response starts, too) or, should that cancellation have been lost, is seen on its
        connection (raises ClientGone; services/router/disconnect.py); ``run`` then cancels
        the request on its workers, as on any disconnect."""
        # Counted from the request's arrival: submit retries already kept the client waiting.
        until_s = choices[0].entry.arrival_s + self.stream_header_hold_s
        try:
            head = await wait_watching(request, steps.get(), until_s=until_s)
        except TimeoutError:
            # vLLM and SGLang send headers at once; past the hold a client's read timeout
            # matters more than a status, so a very late failure stays in-band.
            self.metrics.stream_hold_expired_total.inc()
            log.info(
                "stream_headers_sent_before_first_token",
                request_id=choices[0].entry.request_id,
                held_s=self.stream_header_hold_s,
            )
            return None
        c, _, end = head
        if end is not None and end.failed and not c.text.num_tokens:
            raise end_to_error(end)
        return head

    async def _stream(
        self, request: web.Request, req: GenerationRequest, choices: list[Choice]
    ) -> web.StreamResponse:
        """SSE: each choice's chunks as they come (``index`` tells them apart), then the
        usage (if asked) and ``[DONE]``. A failed choice ends the stream with an error.

        The 200 and its headers wait for the first token of any choice (``_hold``), so a
        request that ends before anything was produced for it gets a plain error status
        (raises ApiError: 503 + Retry-After when dropped past its deadline), never an
        in-band error after a 200 (issue 16)."""
        steps: asyncio.Queue[Step] = asyncio.Queue()

        async def pump(c: Choice) -> None:
            while True:
                pieces, end = await self._collect(c)
                await steps.put((c, "".join(pieces), end))
                if end is not None:
                    return

        pumps = [asyncio.ensure_future(pump(c)) for c in choices]
        try:
            head: Step | None = None
            if self.stream_header_hold_s > 0:
                head = await self._hold(request, steps, choices)
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await response.prepare(request)
            base = envelope(req, choices[0].entry, self.model_name, chunk=True)
            usage_null = {"usage": None} if req.include_usage else {}

            async def send(payload: dict[str, Any]) -> None:
                await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

            if req.kind == "chat":
                for ch in choices:
                    first = choice_object(req, ch, "", None, True, first=True)
                    await send({**base, "choices": [first], **usage_null})
            open_choices = len(choices)
            while open_choices:
                step = head if head is not None else await steps.get()
                head = None
                c, delta, end = step
                if end is not None and end.failed:
                    if delta:
                        part = choice_object(req, c, delta, None, True)
                        await send({**base, "choices": [part], **usage_null})
                    err = end_to_error(end)
                    await send(error_body(err.message, error_type_for(err.http_status), err.code))
                    break
                if delta or end is not None:
                    finish = end.finish_reason if end is not None else None
                    payload = {
                        **base,
                        "choices": [choice_object(req, c, delta, finish, True)],
                        **usage_null,
                    }
                    if end is not None and req.timestamps:
                        payload["fluidpd"] = timing_extension(c.entry, c.text)
                    await send(payload)
                if end is not None:
                    open_choices -= 1
            else:
                if req.include_usage:
                    await send({**base, "choices": [], "usage": usage(choices)})
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        await response.write(SSE_DONE)
        await response.write_eof()
        return response
