"""How a router ranks workers when it pairs a request: the scores, pure.

The router's ``PressurePolicy`` (services/router/pressure_pairing.py) and the simulator's
router (services/sim/router.py) both rank with these functions, so both pair the same way. The
bookkeeping around them (what was sent since a worker's telemetry, settling) stays with
each caller.
"""

from __future__ import annotations


def prefill_wait_s(queue_work_s: float, sent_work_s: float) -> float:
    """Predicted queue wait of a newcomer on a prefill worker, the first rank of a prefill
    pick: the work its telemetry shows queued (``queue_work_s``: Σ T_pre over its queue plus
    the running prefill's remainder) plus the predicted work ``sent_work_s`` (Σ T_pre(L),
    eq. 2) of the requests sent since. It is the quantity the router's door sheds on
    (shared/policy/admission.py), so the worker with the least wait is the one the door
    admits a request to if any does. Ranking on the PPI alone (max over the queue of work
    ahead / time left, eq. 3-5) sent a newcomer to a worker with fresh but long work
    queued, behind deadlines far away, and the door then shed it: at saturation pressure
    pairing shed more than round robin (docs/results.md, Session 11)."""
    return queue_work_s + sent_work_s


def prefill_score(ppi: float, sent_work_s: float, ttft_s: float) -> float:
    """Estimated PPI of a prefill worker: its telemetry PPI raised by the predicted prefill
    work ``sent_work_s`` (Σ T_pre(L) of the requests sent since, eq. 2) over the TTFT budget
    S_TTFT those requests arrived with (eq. 4 with t_ddl − t_now ≈ S_TTFT)."""
    return ppi + sent_work_s / ttft_s


def decode_score(
    dpi_adm: float,
    sent_kv_blocks: int,
    total_blocks: int,
    running: int = 0,
    sent_requests: int = 0,
    max_seqs: int = 0,
) -> float:
    """Estimated admission pressure of a decode worker: its DPI_adm (eq. 8) with the KV
    blocks reserved by the requests sent since its telemetry counted as occupied
    (1 − C_alloc / C_KV with C_alloc lowered), or — when ``max_seqs`` > 0 — the fraction of
    its admission slots those requests and its ``running`` ones fill, whichever is larger.
    Admission stops at either limit; ranking on KV alone sent bursts to a worker with free
    KV and no free slot, where they blocked their prefill workers' queues (retrying)."""
    kv = dpi_adm + sent_kv_blocks / max(1, total_blocks)
    if max_seqs <= 0:
        return kv
    slots = (running + sent_requests) / max_seqs
    return kv if kv > slots else slots
