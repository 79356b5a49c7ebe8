"""Which OpenAI request fields this server implements: the one table.

A field not listed for its endpoint is refused with 400 naming it (``unsupported_parameter``)
instead of being silently ignored (``response_format``, ``logit_bias``, ``tools`` would
otherwise change nothing and return 200). A field in ``NEUTRAL_ONLY`` is accepted only at
a value that asks for nothing (``n: 1``, ``logprobs: false``): we do not implement it, but
clients send the default. ``null`` means "not given" for every field.

To support a field: implement it in openai_api.py, add its name to ``COMMON_FIELDS`` or
the endpoint's set, and remove it from ``NEUTRAL_ONLY``.
"""

from __future__ import annotations

from typing import Any, Literal

from services.router.errors import BadRequest

COMMON_FIELDS = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "stream",
        "stream_options",
        "fluidpd_timestamps",
        "user",  # an end-user id for the caller's own abuse tracking: changes no output
        "n",
        "best_of",
    }
)
SUPPORTED_FIELDS: dict[str, frozenset[str]] = {
    "completion": COMMON_FIELDS | {"prompt", "logprobs", "echo"},
    "chat": COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"},
}
# Not implemented; accepted only at these values (compared with their JSON type).
NEUTRAL_ONLY: dict[str, tuple[Any, ...]] = {
    "top_logprobs": (0,),  # completions: ``logprobs`` is the count there
    "echo": (False,),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (False, True),  # meaningless without tools
    "logit_bias": ({},),
}


def _neutral(name: str, value: Any) -> bool:
    return any(type(value) is type(v) and value == v for v in NEUTRAL_ONLY.get(name, ()))


def check_fields(body: dict[str, Any], kind: Literal["completion", "chat"]) -> None:
    """Raise BadRequest (param = the field) for the first field of ``body`` this server
    does not implement for ``kind``. Does not look at supported fields' values."""
    supported = SUPPORTED_FIELDS[kind]
    for name, value in body.items():
        if value is None or name in supported or _neutral(name, value):
            continue
        if name in NEUTRAL_ONLY:
            shown = ", ".join(repr(v) for v in NEUTRAL_ONLY[name])
            message = f"'{name}' is not supported by this server (allowed: {shown} or null)"
        else:
            message = f"'{str(name)[:64]}' is not supported by this server"
        raise BadRequest(message, param=str(name)[:64], code="unsupported_parameter")
