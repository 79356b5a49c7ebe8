"""Controller control subjects (JSON accepted): status and policy; plus the registry record."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.messages.common import MAX_ERROR_CHARS, MAX_ID_CHARS, Role, check_nonempty
from shared.messages.schema import Message, MessageError

_ID = {"max_len": MAX_ID_CHARS}


@dataclass(frozen=True, kw_only=True)
class StatusRequest(Message):
    """Operator → controller: cluster status; an empty payload or ``{}`` asks for all."""

    TYPE_TAG = "status_request"
    JSON_ACCEPTED = True

    role: Role | None = None


@dataclass(frozen=True, kw_only=True)
class WorkerRow(Message):
    """One worker in a StatusReply (``last_seen_s``: seconds since its last telemetry)."""

    TYPE_TAG = "worker_row"

    worker_id: str = field(metadata=_ID)
    role: Role
    state: str = field(metadata={"max_len": 32})
    free_blocks: int
    total_blocks: int
    ppi: float
    dpi_load: float
    dpi_adm: float
    stolen_tokens: int
    pid: int
    last_seen_s: float


@dataclass(frozen=True, kw_only=True)
class StatusReply(Message):
    """Controller → operator: every live worker and whether the policy runs automatically."""

    TYPE_TAG = "status_reply"
    JSON_ACCEPTED = True

    ok: bool = True
    auto: bool
    time_s: float
    workers: tuple[WorkerRow, ...] = field(default=(), metadata={"max_len": 1024})


@dataclass(frozen=True, kw_only=True)
class PolicyCommand(Message):
    """Operator → controller: ``{"auto": false}`` pauses FluidRole, ``{"auto": true}``
    resumes it."""

    TYPE_TAG = "policy_command"
    JSON_ACCEPTED = True

    auto: bool


@dataclass(frozen=True, kw_only=True)
class PolicyReply(Message):
    """Answer to PolicyCommand: the policy mode now in force."""

    TYPE_TAG = "policy_reply"
    JSON_ACCEPTED = True

    ok: bool
    auto: bool
    error: str | None = field(default=None, metadata={"max_len": MAX_ERROR_CHARS})


@dataclass(frozen=True, kw_only=True)
class SwitchLeaseRequest(Message):
    """Worker → controller, before it accepts a SwitchCommand: may ``worker_id`` leave
    ``from_role`` for ``to_role``? ``release=True`` ends the worker's lease (its switch is
    over; ``from_role`` is then the role it is in now). Answer: SwitchLeaseReply."""

    TYPE_TAG = "switch_lease_request"

    worker_id: str = field(metadata=_ID)
    from_role: Role
    to_role: Role
    release: bool = False

    def check(self) -> None:
        check_nonempty(self.worker_id, "worker_id")


@dataclass(frozen=True, kw_only=True)
class SwitchLeaseReply(Message):
    """Controller → worker: the lease is granted (``ok``) or refused with ``error``."""

    TYPE_TAG = "switch_lease_reply"

    ok: bool
    error: str | None = field(default=None, metadata={"max_len": MAX_ERROR_CHARS})


@dataclass(frozen=True, kw_only=True)
class WorkerRecord(Message):
    """A worker's registry entry (JetStream KV, key = worker_id), rewritten on every
    heartbeat and on every role/state change.

    ``heartbeat_at_s`` is the worker's wall clock at the last write and
    ``heartbeat_period_s`` its heartbeat period; watchers drop a worker whose record they
    have not seen refreshed for 3 periods. ``fingerprint`` identifies model + KV layout
    (transfers between different fingerprints are refused). ``engine`` is "torch" or
    "emulated". ``decode_reserve_tokens`` / ``max_num_seqs``: the worker's decode admission
    (its flags of the same names), for routers' pairing estimates.
    """

    TYPE_TAG = "worker_record"

    worker_id: str = field(metadata=_ID)
    role: Role
    state: str = field(metadata={"max_len": 32})
    pid: int
    host: str
    ucx_address: bytes = b""
    model: str = field(metadata={"max_len": 512})
    fingerprint: str
    kv_total_blocks: int
    kv_block_size: int
    max_model_len: int
    started_at_s: float
    heartbeat_at_s: float
    heartbeat_period_s: float
    engine: str = field(default="torch", metadata={"max_len": 32})
    # Decode-side admission as this worker runs it (routers estimate what a pairing will
    # reserve from these): decode tokens reserved beyond the prompt, and batch slots.
    decode_reserve_tokens: int = 256
    max_num_seqs: int = 64

    def check(self) -> None:
        check_nonempty(self.worker_id, "worker_id")
        if self.heartbeat_period_s <= 0:
            raise MessageError("field heartbeat_period_s: must be > 0")
        if self.decode_reserve_tokens < 0 or self.max_num_seqs < 1:
            raise MessageError("fields decode_reserve_tokens >= 0, max_num_seqs >= 1 required")
        if len(self.ucx_address) > 64 * 1024:
            raise MessageError("field ucx_address: longer than 64 KiB")
