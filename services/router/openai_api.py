"""OpenAI request parsing and validation (completions and chat) → GenerationRequest.

Pure functions over the decoded JSON body; every problem raises BadRequest (400) naming the
parameter, or ModelNotFound (404). Prompts are tokenized as ``fluidpd generate`` does
(no special tokens added; chat via the model's template), so both paths agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from services.router.api_fields import check_fields
from services.router.errors import BadRequest, ModelNotFound
from services.router.prompt_limits import PromptLimits
from shared.errors import FluidPDError, InvalidRequestError
from shared.messages import SamplingParams
from shared.tokenizer import Tokenizer

MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1
MAX_N = 16  # choices per request (n, best_of)
MAX_LOGPROBS = 20  # top logprobs per position (OpenAI's bound; vLLM's default max_logprobs)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request. ``max_tokens`` None means "the default" (resolved later, when
    the context limit is known)."""

    kind: Literal["completion", "chat"]
    prompt_token_ids: tuple[int, ...]
    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    timestamps: bool = False  # extension: per-token receive times in the final chunk
    # Logprobs (services/router/logprobs.py): None = not asked, k = the token's logprob
    # and its k most likely alternatives. ``echo`` (completions): the prompt is returned
    # before the completion, with prompt logprobs when ``logprobs`` is set.
    logprobs: int | None = None
    echo: bool = False
    n: int = 1  # choices, each sampled with its own seed derived from ``seed``
    best_of: int = 1  # samples drawn (>= n); the n with the highest cumulative logprob return

    def sampling(self, max_tokens: int, seed: int, *, sample_logprobs: bool) -> SamplingParams:
        """What the workers sample with (``seed`` resolved by the caller); ``sample_logprobs``:
        the sampled tokens' logprobs come back even when none were asked. Pure."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=seed,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=0 if sample_logprobs and self.logprobs is None else self.logprobs,
            prompt_logprobs=self.logprobs if self.echo else None,
        )


def _encode(
    tokenizer: Tokenizer, text: str, param: str, limits: PromptLimits | None
) -> tuple[int, ...]:
    """``text``'s token ids, tokenized with the GIL released (a long prompt on the parse
    thread must not stall the event loop). Raises BadRequest naming ``param`` for text that
    is not valid Unicode, or (code context_length_exceeded) for text longer than ``limits``
    allows, before any tokenizing."""
    if limits is not None:
        limits.check_chars(len(text), param)
    try:
        return tuple(tokenizer.encode(text, release_gil=True))
    except InvalidRequestError as exc:
        raise BadRequest(str(exc), param=param) from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _get_int(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise BadRequest(f"'{name}' must be an integer", param=name)
    if not lo <= value <= hi:
        raise BadRequest(f"'{name}' must be in [{lo}, {hi}], got {value}", param=name)
    return int(value)


def _get_float(
    body: dict[str, Any], name: str, lo: float, hi: float, default: float, *, lo_open: bool = False
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise BadRequest(f"'{name}' must be a number", param=name)
    if value > hi or value < lo or (lo_open and value == lo):
        bound = "(" if lo_open else "["
        raise BadRequest(f"'{name}' must be in {bound}{lo}, {hi}], got {value}", param=name)
    return float(value)


def _get_bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a boolean", param=name)
    return value


def _stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise BadRequest("'stop' must be a string or a list of strings", param="stop")
    if len(items) > MAX_STOP_STRINGS:
        raise BadRequest(f"'stop' allows at most {MAX_STOP_STRINGS} strings", param="stop")
    return tuple(s for s in items if s)


def _all_ints(values: list[Any]) -> bool:
    """Every item an int, bools excluded. Set of types in C: a per-item Python check cost
    ~1 ms per 8000-token prompt on the TTFT path."""
    return set(map(type, values)) <= {int}


def _token_ids(value: Any, vocab_size: int, param: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not _all_ints(value):
        raise BadRequest(f"'{param}' must be a list of integers", param=param)
    if value and (min(value) < 0 or max(value) >= vocab_size):
        bad = next(t for t in value if not 0 <= t < vocab_size)
        raise BadRequest(f"token id {bad} is out of the vocabulary [0, {vocab_size})", param=param)
    return tuple(value)


def _common(body: Any, model_name: str, kind: Literal["completion", "chat"]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a string", param="model")
    if model != model_name:
        raise ModelNotFound(
            f"the model '{model}' does not exist; this server serves '{model_name}'", param="model"
        )
    check_fields(body, kind)  # anything we do not implement: 400, never ignored
    n = _get_int(body, "n", 1, MAX_N) or 1
    best_of = _get_int(body, "best_of", 1, MAX_N) or n
    if best_of < n:
        raise BadRequest("'best_of' must be >= 'n'", param="best_of")
    if best_of > n and body.get("stream"):
        raise BadRequest("'best_of' > 'n' cannot be streamed", param="best_of")
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise BadRequest("'stream_options' must be an object", param="stream_options")
        include_usage = _get_bool(stream_options, "include_usage")
    return {
        "temperature": _get_float(body, "temperature", 0.0, 2.0, 1.0),
        "top_p": _get_float(body, "top_p", 0.0, 1.0, 1.0, lo_open=True),
        "top_k": max(0, _get_int(body, "top_k", -1, 1 << 30) or 0),  # vLLM: -1 = off
        "seed": _get_int(body, "seed", 0, MAX_SEED),
        "stop": _stop_strings(body),
        "ignore_eos": _get_bool(body, "ignore_eos"),
        "stream": _get_bool(body, "stream"),
        "include_usage": include_usage,
        "timestamps": _get_bool(body, "fluidpd_timestamps"),
        "n": n,
        "best_of": best_of,
    }


def _finish(
    kind: Literal["completion", "chat"],
    ids: tuple[int, ...],
    max_tokens: int | None,
    common: dict[str, Any],
    body: dict[str, Any],
    vocab_size: int,
) -> GenerationRequest:
    if not ids:
        raise BadRequest(
            "the prompt is empty", param="prompt" if kind == "completion" else "messages"
        )
    stop_ids = body.get("stop_token_ids")
    stop_token_ids = () if stop_ids is None else _token_ids(stop_ids, vocab_size, "stop_token_ids")
    if len(stop_token_ids) > 64:
        raise BadRequest("'stop_token_ids' allows at most 64 ids", param="stop_token_ids")
    return GenerationRequest(
        kind=kind,
        prompt_token_ids=ids,
        max_tokens=max_tokens,
        stop_token_ids=stop_token_ids,
        **common,
    )


def parse_completion(
    body: Any, tokenizer: Tokenizer, model_name: str, limits: PromptLimits | None = None
) -> GenerationRequest:
    """Validate a /v1/completions body; text longer than ``limits`` allows is refused
    untokenized (None: no such check). Raises BadRequest / ModelNotFound."""
    common = _common(body, model_name, "completion")
    vocab = tokenizer.vocab_size
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of exactly one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("the prompt is empty", param="prompt")
        ids = _encode(tokenizer, prompt, "prompt", limits)
    elif isinstance(prompt, list) and prompt and _all_ints(prompt):
        ids = _token_ids(prompt, vocab, "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise BadRequest("batched prompts are not supported; send one prompt", param="prompt")
    elif prompt is None:
        raise BadRequest("'prompt' is required", param="prompt")
    else:
        raise BadRequest("'prompt' must be a string or a list of token ids", param="prompt")
    max_tokens = _get_int(body, "max_tokens", 1, 1 << 30)
    if body.get("max_tokens") is None:
        max_tokens = 16  # OpenAI's default for completions
    if body.get("top_logprobs") is not None:
        raise BadRequest("'top_logprobs' is a chat parameter; use 'logprobs'", param="top_logprobs")
    common["logprobs"] = _get_int(body, "logprobs", 0, MAX_LOGPROBS)
    common["echo"] = _get_bool(body, "echo")
    return _finish("completion", ids, max_tokens, common, body, vocab)


def _message_content(msg: Any, i: int) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise BadRequest(f"'{param}' must be an object", param=param)
    role = msg.get("role")
    if role not in CHAT_ROLES:
        raise BadRequest(
            f"'{param}.role' must be one of {', '.join(CHAT_ROLES)}", param=f"{param}.role"
        )
    content = msg.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise BadRequest("only text content parts are supported", param=f"{param}.content")
            texts.append(part["text"])
        content = "".join(texts)
    elif not isinstance(content, str):
        raise BadRequest(
            f"'{param}.content' must be a string or a list of text parts", param=f"{param}.content"
        )
    return {"role": "system" if role == "developer" else role, "content": content}


def parse_chat(
    body: Any, tokenizer: Tokenizer, model_name: str, limits: PromptLimits | None = None
) -> GenerationRequest:
    """Validate a /v1/chat/completions body and render its prompt; messages longer than
    ``limits`` allows are refused before they are rendered or tokenized (None: no such
    check). Raises BadRequest."""
    common = _common(body, model_name, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    rendered = [_message_content(m, i) for i, m in enumerate(messages)]
    if limits is not None:  # the contents alone, before the template renders them
        limits.check_chars(sum(len(m["content"]) for m in rendered), "messages")
    try:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=True)
    except FluidPDError as exc:
        raise BadRequest(str(exc), param="messages") from None
    ids = _encode(tokenizer, text, "messages", limits)
    if body.get("echo") not in (None, False):
        raise BadRequest("'echo' is a completions parameter", param="echo")
    top = _get_int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if _get_bool(body, "logprobs"):
        common["logprobs"] = top or 0
    elif top is not None:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    max_tokens = _get_int(body, "max_completion_tokens", 1, 1 << 30)
    if max_tokens is None:
        max_tokens = _get_int(body, "max_tokens", 1, 1 << 30)
    return _finish("chat", ids, max_tokens, common, body, tokenizer.vocab_size)


def resolve_max_tokens(req: GenerationRequest, max_model_len: int) -> int:
    """The request's max_tokens within the context limit. Raises BadRequest
    (code ``context_length_exceeded``) when prompt + max_tokens does not fit."""
    prompt_len = len(req.prompt_token_ids)
    param = "max_tokens" if req.max_tokens is not None else "messages"
    room = max_model_len - prompt_len
    max_tokens = req.max_tokens if req.max_tokens is not None else room
    if room < 1 or max_tokens > room:
        raise BadRequest(
            f"this model's maximum context length is {max_model_len} tokens; the request has "
            f"{prompt_len} prompt tokens and asks for {max_tokens} completion tokens",
            param=param,
            code="context_length_exceeded",
        )
    return max_tokens
