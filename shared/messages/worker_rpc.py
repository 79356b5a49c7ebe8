"""Requests addressed to one worker: prefill, admit, cancel, switch, migrate.

Size bound (see shared.messages.limits): the only unbounded-looking fields are token id
lists; every other field has a ``max_len``. Token id lists are bounded by the model context
(the router refuses longer prompts) and ``MAX_WIRE_TOKEN_IDS`` caps the context itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.messages.common import (
    MAX_ERROR_CHARS,
    MAX_ID_CHARS,
    MAX_SUBJECT_CHARS,
    Role,
    SamplingParams,
    check_nonempty,
    check_nonnegative,
)
from shared.messages.limits import MAX_TOKEN_ID, MAX_WIRE_BLOCKS, MAX_WIRE_TOKEN_IDS
from shared.messages.schema import Message, MessageError

_ID = {"max_len": MAX_ID_CHARS}
_SUBJ = {"max_len": MAX_SUBJECT_CHARS}
_TOKENS = {"max_len": MAX_WIRE_TOKEN_IDS}
_MAX_BLOCKS = MAX_WIRE_BLOCKS


def _check_token_ids(token_ids: tuple[int, ...], name: str) -> None:
    # < 2**32 keeps each id at <= 5 msgpack bytes, which the size bound relies on.
    if token_ids and not (min(token_ids) >= 0 and max(token_ids) <= MAX_TOKEN_ID):
        raise MessageError(f"field {name}: token ids must be in [0, 2**32)")


@dataclass(frozen=True, kw_only=True)
class PrefillRequest(Message):
    """Router → prefill worker (request/reply; reply Ack or ErrorReply).

    ``arrival_time_s`` and ``ttft_deadline_s`` are the router's wall clock (absolute); the
    worker uses their difference as the TTFT budget, anchored on its own receive time, so
    clock skew between hosts does not move deadlines. ``tokens_subject`` is where the first
    token (and later decode tokens) stream to. Higher ``priority`` is served first.
    """

    TYPE_TAG = "prefill_request"

    request_id: str = field(metadata=_ID)
    router_id: str = field(metadata=_ID)
    prompt_token_ids: tuple[int, ...] = field(metadata=_TOKENS)
    sampling: SamplingParams
    decode_worker_id: str = field(metadata=_ID)
    arrival_time_s: float
    ttft_deadline_s: float
    tokens_subject: str = field(metadata=_SUBJ)
    priority: int = 0
    # Debug/test knob: split this prompt at beta (suffix = beta * L) instead of Algorithm 1.
    force_steal_ratio: float | None = None

    def check(self) -> None:
        check_nonempty(self.request_id, "request_id")
        if not self.prompt_token_ids:
            raise MessageError("field prompt_token_ids: must not be empty")
        _check_token_ids(self.prompt_token_ids, "prompt_token_ids")
        if self.force_steal_ratio is not None and not 0.0 <= self.force_steal_ratio < 1.0:
            raise MessageError("field force_steal_ratio: must be in [0, 1)")
        if self.ttft_deadline_s < self.arrival_time_s:
            raise MessageError("field ttft_deadline_s: before arrival_time_s")


@dataclass(frozen=True, kw_only=True)
class AdmitRequest(Message):
    """Prefill worker → decode worker: reserve KV blocks for a request (reply AdmitReply).

    ``suffix_len`` > 0 means a FluidToken split: the prefill side computes
    ``prompt_len - suffix_len`` tokens and the decode side the rest.
    """

    TYPE_TAG = "admit_request"

    request_id: str = field(metadata=_ID)
    router_id: str = field(metadata=_ID)
    prompt_len: int
    max_tokens: int
    prefill_worker_id: str = field(metadata=_ID)
    suffix_len: int = 0
    sampling: SamplingParams
    tokens_subject: str = field(metadata=_SUBJ)
    forced_split: bool = False  # the split came from force_steal_ratio: skip the budget check
    # The suffix's token ids (the decode side computes their KV): len == suffix_len.
    suffix_token_ids: tuple[int, ...] = field(default=(), metadata=_TOKENS)

    def check(self) -> None:
        check_nonempty(self.request_id, "request_id")
        if not 0 < self.prompt_len <= MAX_WIRE_TOKEN_IDS:
            raise MessageError("field prompt_len: out of range")
        if self.max_tokens < 1:
            raise MessageError("field max_tokens: must be >= 1")
        if not 0 <= self.suffix_len < self.prompt_len:
            raise MessageError("field suffix_len: must be in [0, prompt_len)")
        if len(self.suffix_token_ids) != self.suffix_len:
            raise MessageError("field suffix_token_ids: must hold suffix_len ids")
        _check_token_ids(self.suffix_token_ids, "suffix_token_ids")


@dataclass(frozen=True, kw_only=True)
class AdmitReply(Message):
    """Decode worker's answer to AdmitRequest (or MigrateRequest).

    ok=True: ``block_ids``/``generations`` (same length) are the reserved destination
    blocks and their generation ids, ``ucx_address`` the decode worker's UCX worker
    address, ``transfer_id`` (u64) names the transfer in the KV envelope. ok=False:
    ``error`` says why; ``retry_after_ms`` is set when retrying later may succeed.
    """

    TYPE_TAG = "admit_reply"

    ok: bool
    transfer_id: int = 0
    block_ids: tuple[int, ...] = field(default=(), metadata={"max_len": _MAX_BLOCKS})
    generations: tuple[int, ...] = field(default=(), metadata={"max_len": _MAX_BLOCKS})
    ucx_address: bytes = b""
    ticket: bytes = b""  # the receiver's sealed TransferTicket (shared.transfer.envelope)
    suffix_len: int = 0  # suffix tokens the decode side accepted (may be less than asked)
    error: str | None = field(default=None, metadata={"max_len": MAX_ERROR_CHARS})
    retry_after_ms: int | None = None

    def check(self) -> None:
        if not 0 <= self.transfer_id < 2**64:
            raise MessageError("field transfer_id: must be a u64")
        if len(self.block_ids) != len(self.generations):
            raise MessageError("fields block_ids/generations: lengths differ")
        if len(self.ticket) > 256 * 1024:
            raise MessageError("field ticket: longer than 256 KiB")
        if self.suffix_len < 0:
            raise MessageError("field suffix_len: must be >= 0")
        if len(self.ucx_address) > 64 * 1024:
            raise MessageError("field ucx_address: longer than 64 KiB")
        if not self.ok and not self.error:
            raise MessageError("field error: required when ok=false")


@dataclass(frozen=True, kw_only=True)
class CancelRequest(Message):
    """Router → any worker (publish): stop work on ``request_id`` and free its blocks.

    Accepts JSON (``{"request_id": "r1"}``). Unknown request ids are ignored.
    """

    TYPE_TAG = "cancel_request"
    JSON_ACCEPTED = True

    request_id: str = field(metadata=_ID)
    reason: str = field(default="cancelled", metadata={"max_len": 256})

    def check(self) -> None:
        check_nonempty(self.request_id, "request_id")


@dataclass(frozen=True, kw_only=True)
class SwitchCommand(Message):
    """Operator/controller → worker (request/reply, JSON accepted): switch role in place."""

    TYPE_TAG = "switch_command"
    JSON_ACCEPTED = True

    role: Role


@dataclass(frozen=True, kw_only=True)
class SwitchReply(Message):
    """Answer to SwitchCommand: ``{"ok":true,"from":"decode","to":"prefill"}`` or
    ``{"ok":false,"error":"..."}``."""

    TYPE_TAG = "switch_reply"
    JSON_ACCEPTED = True

    ok: bool
    from_role: Role | None = field(default=None, metadata={"wire": "from"})
    to_role: Role | None = field(default=None, metadata={"wire": "to"})
    error: str | None = field(default=None, metadata={"max_len": MAX_ERROR_CHARS})

    def check(self) -> None:
        if not self.ok and not self.error:
            raise MessageError("field error: required when ok=false")


@dataclass(frozen=True, kw_only=True)
class MigrateRequest(Message):
    """Decode worker → decode peer: take over a running request (reply AdmitReply).

    The peer reserves blocks for ``num_tokens`` tokens of KV and answers like an admit;
    the KV then moves as in a prefill hand-off (the envelope's atomic install completes it).
    ``generated_token_ids`` are the tokens generated so far (already streamed to the
    router); ``rng_offset`` is the number of sampler draws made so far (seeded sampling).
    """

    TYPE_TAG = "migrate_request"

    request_id: str = field(metadata=_ID)
    router_id: str = field(metadata=_ID)
    tokens_subject: str = field(metadata=_SUBJ)
    source_worker_id: str = field(metadata=_ID)
    prompt_len: int
    num_tokens: int
    generated_token_ids: tuple[int, ...] = field(metadata=_TOKENS)
    sampling: SamplingParams
    rng_offset: int = 0

    def check(self) -> None:
        check_nonempty(self.request_id, "request_id")
        if not 0 < self.num_tokens <= MAX_WIRE_TOKEN_IDS:
            raise MessageError("field num_tokens: out of range")
        check_nonnegative(self.prompt_len, "prompt_len")
        check_nonnegative(self.rng_offset, "rng_offset")
        _check_token_ids(self.generated_token_ids, "generated_token_ids")
