"""What FluidRole sees of the cluster, and the pure reads over it (paper §IV-C2).

``WorkerView`` is one worker as the controller's registry and telemetry show it (the
simulator builds the same); ``ClusterSnapshot`` is one decision interval's set. The
functions read a snapshot: eq. 20–21's aggregates, the decode backlog FluidRole sizes
moves against, the prefill workers' busy fraction, and which workers a move takes (rule 8
of fluidrole.py). Pure; nothing here holds state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.policy.admission import least_decode_backlog_batches
from shared.policy.decode_flow import FlowCounters
from shared.policy.fluidrole_rules import D2P, P2D
from shared.policy.fluidrole_sizing import DecodeDemand
from shared.policy.roles import ACTIVE, DECODE, PREFILL


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What the controller knows about one worker. Fields of the other role are ignored."""

    worker_id: str
    role: str  # PREFILL | DECODE (the role it serves now, or is leaving while draining)
    state: str = ACTIVE  # ACTIVE | DRAIN | SWITCH
    ppi_p95: float = 0.0  # prefill: PPI^95(p) over the window (eq. 20)
    # prefill: its latest PPI sample (eq. 3–5), the queue as it is now; None = not reported
    # (read as ppi_p95).
    ppi_now: float | None = None
    dpi_load: float = 0.0  # decode: eq. 7
    dpi_adm: float = 0.0  # decode: eq. 8
    active_decode_requests: int = 0  # decode: D→P drain proxy
    kv_active_tokens: int = 0  # decode: tie-break for D→P
    running_prefill_tokens: int = 0  # prefill: P→D drain (prefill it must finish)
    prefill_busy_frac: float = 0.0  # prefill: seconds computing per second (busy.py)
    queue_len: int = 0  # prefill: requests to reassign on P→D
    decode_waiting: int = 0  # decode: requests refused for capacity, waiting to be admitted
    max_decode_requests: int = 0  # decode: its batch limit (max_num_seqs; 0 = unknown)
    # Its process's decode flow counters, any role (decode_flow.py); None = no fresh telemetry.
    decode_counters: FlowCounters | None = None


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    workers: tuple[WorkerView, ...]


def aggregate_pressure(workers: Sequence[WorkerView]) -> tuple[float, float, float, int, int]:
    """Eq. 20–21 over Active workers: (PPI̅, DPI̅_load, DPI̅_adm, n_prefill, n_decode)."""
    ppi_bar = 0.0
    load_sum = adm_sum = 0.0
    n_p = n_d = 0
    for w in workers:
        if w.state != ACTIVE:
            continue
        if w.role == PREFILL:
            n_p += 1
            ppi_bar = max(ppi_bar, w.ppi_p95)
        elif w.role == DECODE:
            n_d += 1
            load_sum += w.dpi_load
            adm_sum += w.dpi_adm
    return (ppi_bar, load_sum / n_d if n_d else 0.0, adm_sum / n_d if n_d else 0.0, n_p, n_d)


def prefill_ppi_now(workers: Sequence[WorkerView]) -> float:
    """max over Active prefill workers of their latest PPI sample (its windowed PPI^95 where
    none is reported; 0 when no prefill worker is Active): PPI̅ without eq. 20's window."""
    return max(
        (
            w.ppi_p95 if w.ppi_now is None else w.ppi_now
            for w in workers
            if w.state == ACTIVE and w.role == PREFILL
        ),
        default=0.0,
    )


def decode_demand(workers: Sequence[WorkerView]) -> DecodeDemand:
    """The decode backlog — running decodes and requests waiting for decode admission on
    every decode-role worker (draining ones too: their decodes move to the others) — and
    the decode workers' batch limit (the largest one reported; 0 when none is)."""
    requests = slots = 0
    for w in workers:
        if w.role == DECODE:
            requests += w.active_decode_requests + w.decode_waiting
            slots = max(slots, w.max_decode_requests)
    return DecodeDemand(requests, slots)


def decode_waiting_batches(workers: Sequence[WorkerView]) -> float | None:
    """The least decode backlog waiting for admission over the Active decode workers that
    report their batch limit, in batches: the measure the router's door sheds on
    (admission.least_decode_backlog_batches). None when no such worker is Active."""
    return least_decode_backlog_batches(
        (w.decode_waiting, w.max_decode_requests)
        for w in workers
        if w.state == ACTIVE and w.role == DECODE and w.max_decode_requests > 0
    )


def prefill_busy_mean(workers: Sequence[WorkerView]) -> float:
    """Mean busy fraction (shared/policy/busy.py) of the Active prefill workers (0 if none)."""
    vals = [w.prefill_busy_frac for w in workers if w.state == ACTIVE and w.role == PREFILL]
    return sum(vals) / len(vals) if vals else 0.0


def pick_candidates(workers: Sequence[WorkerView], action: str, k: int) -> list[WorkerView]:
    """The ``k`` Active workers of the source role with the least expected drain (rule 8)."""
    if action == D2P:
        pool = [w for w in workers if w.state == ACTIVE and w.role == DECODE]
        pool.sort(key=lambda w: (w.active_decode_requests, w.kv_active_tokens, w.worker_id))
    elif action == P2D:
        pool = [w for w in workers if w.state == ACTIVE and w.role == PREFILL]
        pool.sort(key=lambda w: (w.running_prefill_tokens, w.queue_len, w.worker_id))
    else:
        return []
    return pool[:k]
