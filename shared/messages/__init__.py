"""Subjects, typed messages and the wire codec (msgpack; JSON on control subjects).

Import from here: ``from shared.messages import Subjects, SwitchCommand, encode, decode``.
"""

from shared.messages.codec import decode, decode_reply, decode_with_format, encode, is_json
from shared.messages.common import ROLES, Ack, ErrorReply, Role, SamplingParams
from shared.messages.control import (
    PolicyCommand,
    PolicyReply,
    StatusReply,
    StatusRequest,
    SwitchLeaseReply,
    SwitchLeaseRequest,
    WorkerRecord,
    WorkerRow,
)
from shared.messages.limits import (
    MAX_MESSAGE_BYTES,
    MAX_WIRE_BLOCKS,
    MAX_WIRE_TOKEN_IDS,
    check_context_fits,
)
from shared.messages.schema import Message, MessageError, MessageTooLargeError
from shared.messages.sequence import Observation, SequenceTracker, StreamSequencer
from shared.messages.streams import (
    ABORT_REASONS,
    ControllerDecision,
    StateEvent,
    StreamMessage,
    TokenBatch,
    TokenItem,
    TokenLogprob,
    WorkerTelemetry,
)
from shared.messages.subjects import Subjects
from shared.messages.token_batching import pack_token_batches
from shared.messages.worker_rpc import (
    AdmitReply,
    AdmitRequest,
    CancelRequest,
    MigrateRequest,
    PrefillRequest,
    SwitchCommand,
    SwitchReply,
)

# Every concrete message type (tests iterate over it; tags must be unique).
ALL_MESSAGE_TYPES: tuple[type[Message], ...] = (
    SamplingParams,
    Ack,
    ErrorReply,
    PrefillRequest,
    AdmitRequest,
    AdmitReply,
    CancelRequest,
    SwitchCommand,
    SwitchReply,
    MigrateRequest,
    TokenLogprob,
    TokenItem,
    TokenBatch,
    WorkerTelemetry,
    StateEvent,
    ControllerDecision,
    StatusRequest,
    WorkerRow,
    StatusReply,
    PolicyCommand,
    PolicyReply,
    SwitchLeaseRequest,
    SwitchLeaseReply,
    WorkerRecord,
)

__all__ = [
    "ABORT_REASONS",
    "ALL_MESSAGE_TYPES",
    "MAX_MESSAGE_BYTES",
    "MAX_WIRE_BLOCKS",
    "MAX_WIRE_TOKEN_IDS",
    "ROLES",
    "Ack",
    "AdmitReply",
    "AdmitRequest",
    "CancelRequest",
    "ControllerDecision",
    "ErrorReply",
    "Message",
    "MessageError",
    "MessageTooLargeError",
    "MigrateRequest",
    "Observation",
    "PolicyCommand",
    "PolicyReply",
    "PrefillRequest",
    "Role",
    "SamplingParams",
    "SequenceTracker",
    "StateEvent",
    "StatusReply",
    "StatusRequest",
    "StreamMessage",
    "StreamSequencer",
    "Subjects",
    "SwitchCommand",
    "SwitchLeaseReply",
    "SwitchLeaseRequest",
    "SwitchReply",
    "TokenBatch",
    "TokenItem",
    "TokenLogprob",
    "WorkerRecord",
    "WorkerRow",
    "WorkerTelemetry",
    "check_context_fits",
    "decode",
    "decode_reply",
    "decode_with_format",
    "encode",
    "is_json",
    "pack_token_batches",
]
