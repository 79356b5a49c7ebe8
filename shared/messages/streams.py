"""Stream messages (published, not requested): tokens, telemetry, state events, decisions.

Every stream message carries ``publisher_id``, ``epoch`` and ``seq``. ``epoch`` names one
incarnation of the publisher (its start time in ns), so a restarted worker that starts
again at seq 0 is not mistaken for a stream of duplicates; ``seq`` increases by one per
message on one subject. Receivers use shared.messages.sequence.SequenceTracker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.messages.common import MAX_ERROR_CHARS, MAX_ID_CHARS, Role, check_nonempty
from shared.messages.schema import Message, MessageError

_ID = {"max_len": MAX_ID_CHARS}
MAX_ITEM_TOKENS = 4096
MAX_TIMESTAMPS = 32
MAX_FINISH_REASON_CHARS = 32
# Finish reasons that end a stream at once, whatever tokens are still in flight.
ABORT_REASONS = ("error", "cancelled")
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, kw_only=True)
class StreamMessage(Message):
    """Base of stream messages: who published it, which incarnation, which position."""

    publisher_id: str = field(metadata=_ID)
    epoch: int
    seq: int

    def check(self) -> None:
        check_nonempty(self.publisher_id, "publisher_id")
        if self.seq < 0 or self.epoch < 0:
            raise MessageError("fields epoch/seq: must be >= 0")


@dataclass(frozen=True, kw_only=True)
class TokenLogprob(Message):
    """One scored token (shared/engine/logprobs.py): its logprob and the top ids/logprobs
    at its position, most likely first. Sent only for requests that ask for logprobs."""

    TYPE_TAG = "token_logprob"
    WIRE_ARRAY = True

    logprob: float
    top_ids: tuple[int, ...] = field(default=(), metadata={"max_len": MAX_TOP_LOGPROBS})
    top_logprobs: tuple[float, ...] = field(default=(), metadata={"max_len": MAX_TOP_LOGPROBS})

    def check(self) -> None:
        if len(self.top_ids) != len(self.top_logprobs):
            raise MessageError("fields top_ids/top_logprobs: must have the same length")


@dataclass(frozen=True, kw_only=True)
class TokenItem(Message):
    """New tokens of one request in one worker iteration.

    ``finish_reason`` ("stop", "length", "cancelled", "error") marks the last item of a
    request; ``error``/``error_code`` say why it failed. ``timestamps`` carries optional
    named wall-clock instants for the TTFT breakdown (e.g. "prefill_start_s").

    Only for requests that ask (empty otherwise, one byte each on the wire):
    ``logprobs[i]`` scores ``token_ids[i]``; ``prompt_logprobs[j]`` scores prompt token
    ``prompt_logprobs_start + j`` (the worker that computed that prompt position sends it;
    an item may carry prompt logprobs and no tokens).
    """

    TYPE_TAG = "token_item"
    WIRE_ARRAY = True  # sent in bulk inside TokenBatch: an array, not a map, on the wire

    request_id: str = field(metadata=_ID)
    index: int = 0  # position of token_ids[0] in the request's output (ordering, dedupe)
    token_ids: tuple[int, ...] = field(default=(), metadata={"max_len": MAX_ITEM_TOKENS})
    finish_reason: str | None = field(default=None, metadata={"max_len": MAX_FINISH_REASON_CHARS})
    error: str | None = field(default=None, metadata={"max_len": MAX_ERROR_CHARS})
    error_code: str | None = field(default=None, metadata={"max_len": 64})
    timestamps: dict[str, float] = field(default_factory=dict, metadata={"max_len": MAX_TIMESTAMPS})
    logprobs: tuple[TokenLogprob, ...] = field(default=(), metadata={"max_len": MAX_ITEM_TOKENS})
    prompt_logprobs_start: int = 0
    prompt_logprobs: tuple[TokenLogprob, ...] = field(
        default=(), metadata={"max_len": MAX_ITEM_TOKENS}
    )
    # Chain of custody: the publisher, a worker the router has bound to this request, hands
    # its ``handed_role`` part ("prefill" or "decode") to worker ``handed_to`` (a queue
    # hand-off at a P->D switch, a re-pairing with another decode worker). The router then
    # accepts that worker's items for the request; nobody else can rebind a stream.
    handed_to: str | None = field(default=None, metadata=_ID)
    handed_role: Role | None = None

    @classmethod
    def hand_over(cls, request_id: str, to_worker_id: str, role: Role) -> TokenItem:
        """The custody notice: the publisher hands ``request_id``'s ``role`` part to
        ``to_worker_id`` (the router then takes that worker's items for it)."""
        return cls(request_id=request_id, handed_to=to_worker_id, handed_role=role)

    def check(self) -> None:
        if (self.handed_to is None) != (self.handed_role is None):
            raise MessageError("fields handed_to/handed_role: both or neither")
        if self.logprobs and len(self.logprobs) != len(self.token_ids):
            raise MessageError("field logprobs: one per token id when present")
        if self.prompt_logprobs_start < 0:
            raise MessageError("field prompt_logprobs_start: must be >= 0")


@dataclass(frozen=True, kw_only=True)
class TokenBatch(StreamMessage):
    """Worker → router: all of this worker's new tokens for that router's requests in one
    decode iteration (so the bus message rate does not grow with the number of streams).
    Build with shared.messages.token_batching.pack_token_batches to respect the size bound.
    """

    TYPE_TAG = "token_batch"

    items: tuple[TokenItem, ...] = field(metadata={"max_len": 65536})


@dataclass(frozen=True, kw_only=True)
class WorkerTelemetry(StreamMessage):
    """Worker → controller/peers, every ~20 ms: load and pressure signals.

    ``ppi`` (eq. 3–5), ``dpi_load``/``dpi_adm`` (eq. 6–8); ``steal_budgets`` maps a
    prefill worker id to the suffix tokens this decode worker can absorb for it (eq. 16–17).
    ``metrics`` holds extra named numbers.
    """

    TYPE_TAG = "worker_telemetry"

    time_s: float
    role: Role
    state: str = field(metadata={"max_len": 32})
    queue_len: int
    running: int
    free_blocks: int
    total_blocks: int
    ppi: float
    dpi_load: float
    dpi_adm: float
    steal_budgets: dict[str, int] = field(default_factory=dict, metadata={"max_len": 1024})
    stolen_tokens_total: int = 0
    metrics: dict[str, float] = field(default_factory=dict, metadata={"max_len": 256})


@dataclass(frozen=True, kw_only=True)
class StateEvent(StreamMessage):
    """Worker → anyone: a lifecycle state change (e.g. active → draining)."""

    TYPE_TAG = "state_event"

    time_s: float
    role: Role
    from_state: str = field(metadata={"max_len": 32})
    to_state: str = field(metadata={"max_len": 32})
    reason: str = field(default="", metadata={"max_len": 512})


@dataclass(frozen=True, kw_only=True)
class ControllerDecision(StreamMessage):
    """Controller → anyone: one FluidRole decision and the inputs it was made from."""

    TYPE_TAG = "controller_decision"

    time_s: float
    action: str = field(metadata={"max_len": 64})
    target_worker_id: str | None = field(default=None, metadata=_ID)
    reason: str = field(default="", metadata={"max_len": 512})
    inputs: dict[str, float] = field(default_factory=dict, metadata={"max_len": 256})
