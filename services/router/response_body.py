"""The OpenAI response objects of a generation: the envelope (id, object, created, model),
one choice (whole message, streamed delta or completion text), the usage and FluidPD's
``fluidpd`` timing extension. Pure functions over the request and its choices; the
handler (generate.py) decides when each is sent."""

from __future__ import annotations

from typing import Any

from services.router.choice import Choice, TextAssembler
from services.router.in_flight import InFlight
from services.router.openai_api import GenerationRequest


def envelope(
    req: GenerationRequest, entry: InFlight, model_name: str, chunk: bool
) -> dict[str, Any]:
    """The fields every response (or stream chunk) of ``entry`` starts with. Pure."""
    if req.kind == "chat":
        obj = "chat.completion.chunk" if chunk else "chat.completion"
        prefix = "chatcmpl-"
    else:
        obj, prefix = "text_completion", "cmpl-"
    return {
        "id": prefix + entry.request_id,
        "object": obj,
        "created": int(entry.arrival_s),
        "model": model_name,
    }


def choice_object(
    req: GenerationRequest,
    choice: Choice,
    text: str | None,
    finish: str | None,
    chunk: bool,
    first: bool = False,
) -> dict[str, Any]:
    """One choice object. Takes the choice's pending logprobs (mutates ``choice``), except
    for the ``first`` (role) chunk of a chat stream, which carries no token: with the header
    hold its first token is already in when the role chunk goes out, and its logprobs belong
    to the chunk with its text."""
    logprobs: dict[str, Any] | None
    if first:
        logprobs = None if choice.logprobs is None else {"content": []}
    else:
        logprobs = choice.take_logprobs()
    i = choice.index
    if req.kind == "completion":
        return {"index": i, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    if chunk:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return {
        "index": i,
        "message": {"role": "assistant", "content": text or ""},
        "logprobs": logprobs,
        "finish_reason": finish,
    }


def usage(choices: list[Choice]) -> dict[str, int]:
    """Prompt and completion token counts over all ``choices`` of one request. Pure."""
    prompt = choices[0].entry.prompt_len
    completion = sum(c.text.num_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def timing_extension(entry: InFlight, text: TextAssembler) -> dict[str, Any]:
    """The ``fluidpd`` object (``timestamps: true``): workers and per-token times. Pure."""
    return {
        "request_id": entry.request_id,
        "prefill_worker": entry.prefill_id,
        "decode_worker": entry.decode_id,
        "arrival_s": entry.arrival_s,
        "sent_s": entry.sent_s,
        "token_receive_s": text.receive_times_s,
        "worker_timestamps": entry.stream.timestamps,
    }
