"""Messages and value types used by several subjects: sampling parameters, Ack, ErrorReply."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.messages.schema import Message, MessageError

# Defined once in the policy layer (the bottom one); re-exported for message users.
from shared.policy.roles import ROLES as ROLES
from shared.policy.roles import Role as Role

MAX_STOP_TOKEN_IDS = 64
MAX_ERROR_CHARS = 2048
# Identifiers (request, router, worker ids) stay short so message envelopes have a bound.
MAX_ID_CHARS = 128
MAX_SUBJECT_CHARS = 256


def _id(**extra: object) -> dict[str, object]:
    return {"max_len": MAX_ID_CHARS, **extra}


def check_nonempty(value: str, name: str) -> None:
    """Raise MessageError when ``value`` is empty."""
    if not value:
        raise MessageError(f"field {name}: must not be empty")


def check_nonnegative(value: int | float, name: str) -> None:
    """Raise MessageError when ``value`` < 0."""
    if value < 0:
        raise MessageError(f"field {name}: must be >= 0")


@dataclass(frozen=True, kw_only=True)
class SamplingParams(Message):
    """Per-request sampling parameters (stop *strings* are handled by the router).

    ``top_k == 0`` disables top-k; ``seed is None`` means an unseeded generator.
    """

    TYPE_TAG = "sampling_params"

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=(), metadata={"max_len": MAX_STOP_TOKEN_IDS})
    ignore_eos: bool = False
    # None = not asked; k = the token's logprob plus the k most likely (k <= 20).
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def check(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                raise MessageError(f"field {name}: must be in [0, 20]")
        if self.max_tokens < 1:
            raise MessageError("field max_tokens: must be >= 1")
        check_nonnegative(self.temperature, "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise MessageError("field top_p: must be in (0, 1]")
        check_nonnegative(self.top_k, "top_k")


@dataclass(frozen=True, kw_only=True)
class Ack(Message):
    """Positive reply to a request that needs no data back (e.g. a queued PrefillRequest)."""

    TYPE_TAG = "ack"
    JSON_ACCEPTED = True

    ok: bool = True
    request_id: str = field(default="", metadata=_id())


@dataclass(frozen=True, kw_only=True)
class ErrorReply(Message):
    """Reply to any request that failed; ``code`` is a shared.errors code.

    In JSON (operator requests) it reads ``{"ok": false, "code": ..., "error": ...}``.
    ``retry_after_ms`` is set when the failure is transient (e.g. no KV capacity).
    """

    TYPE_TAG = "error_reply"
    JSON_ACCEPTED = True

    ok: bool = False
    code: str = field(default="internal_error", metadata={"max_len": 64})
    error: str = field(default="", metadata={"max_len": MAX_ERROR_CHARS})
    retry_after_ms: int | None = None

    def check(self) -> None:
        if self.ok:
            raise MessageError("field ok: an error reply has ok=false")
