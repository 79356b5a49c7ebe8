"""Which Active decode worker can take a request now: the prefill side's choice when its
paired decode worker has no capacity (it re-pairs a waiting request instead of waiting for
that one), and when the paired worker stopped decoding. Pure: reads registry records and
the decode workers' latest telemetry (``DecodeView``), mutates nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.messages import WorkerRecord
from shared.policy.pressure import admission_kv_tokens

FRESH_S = 0.5  # telemetry older than this (25 periods) says nothing about capacity now


@dataclass(frozen=True, slots=True)
class DecodeView:
    """What a decode worker's last telemetry said about its admission capacity."""

    received_s: float  # our monotonic clock
    free_blocks: int
    admitted: int  # running + receiving
    waiting: int  # requests it refused and that still wait for it
    waiting_blocks: int = 0  # the KV blocks those would reserve


def free_slots(view: DecodeView, rec: WorkerRecord) -> int:
    """Admission slots left once the requests already waiting for it are served."""
    return rec.max_num_seqs - view.admitted - view.waiting


def pick_with_capacity(
    records: Sequence[WorkerRecord],
    views: Mapping[str, DecodeView],
    now_s: float,
    *,
    prompt_tokens: int,
    max_tokens: int,
    exclude: frozenset[str] = frozenset(),
) -> str | None:
    """The candidate (not in ``exclude``) with fresh telemetry, a free slot beyond those
    already waiting for it and, beyond what those would reserve, the KV blocks the
    request reserves; the one with the most
    free blocks (ties: id). None when none qualifies."""
    best: tuple[int, str] | None = None
    for rec in records:
        view = views.get(rec.worker_id)
        if rec.worker_id in exclude or view is None or now_s - view.received_s > FRESH_S:
            continue
        kv = admission_kv_tokens(
            prompt_tokens, max_tokens, rec.decode_reserve_tokens, rec.max_model_len
        )
        need = -(-kv // max(1, rec.kv_block_size))
        if free_slots(view, rec) <= 0 or view.free_blocks - view.waiting_blocks < need:
            continue
        key = (-view.free_blocks, rec.worker_id)
        if best is None or key < best:
            best = key
    return None if best is None else best[1]
