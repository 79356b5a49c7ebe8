"""Snapshots the roles hand out (``stats()``): what telemetry, the policy and the metrics
read, instead of reaching into a role's tables. Frozen: a snapshot never changes under its
reader. Sizes carry their units (``_tokens``, ``_blocks``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.policy.prefill_pressure import QueuedRequest


@dataclass(frozen=True, slots=True)
class PoolStats:
    """The KV pool as the block manager sees it now."""

    block_size: int
    free_blocks: int
    usable_blocks: int
    reserved_blocks: int


@dataclass(frozen=True, slots=True)
class DecodeStats:
    pool: PoolStats
    max_num_seqs: int
    num_requests: int  # running + receiving
    num_running: int
    num_receiving: int
    running_kv_tokens: int  # context of the runnable requests
    pending_prompt_tokens: int  # stolen suffixes / local prompts accepted, not yet computed
    waiting_requests: int  # refused admits their prefill workers retry (decode_waiting.py)
    waiting_kv_tokens: int
    stolen_tokens_total: int
    refused_steals_total: int
    migrations_in_total: int
    migrations_in_failed_total: int
    migrations_out_total: int
    iterations_total: int
    entered_total: int  # requests that joined the batch (decode flow, decode_flow.py)
    left_total: int  # requests that left it


@dataclass(frozen=True, slots=True)
class PrefillStats:
    queue: tuple[QueuedRequest, ...]  # head first (not the running prefill)
    queue_len: int  # queued + the running prefill
    running_prompt_tokens: int  # 0 when no prefill runs
    running_started_s: float | None  # wall clock; None before the step started
    handed_off_tokens_total: int
    split_requests_total: int
    prefills_total: int
    busy_s_total: float  # seconds spent computing prompts (FluidRole's busy fraction)
    expired_total: int
    admission_waiting: int  # requests waiting here for decode capacity
    decode_wait_timeouts_total: int
    repaired_for_capacity_total: int


@dataclass(frozen=True, slots=True)
class SwitchStats:
    switches_total: int = 0
    # The last completed switch's phases (empty before the first).
    last_durations_ms: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PressureSignals:
    """The policy's last computed signals (services/worker/policy.py)."""

    ppi: float
    dpi_load: float
    dpi_adm: float
    steal_budget_tokens: float
    queue_work_s: float
