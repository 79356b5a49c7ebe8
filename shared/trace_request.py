"""One request of a replayed workload: the record the trace loader builds and the
simulator consumes.

Defined here, below both, so that services/sim does not import from services/bench (which
builds workloads from the packaged Azure traces: services/bench/workloads.py). Pure data,
no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request to replay. ``window`` is the stage index (azure-staged: 0, 1, 2; azure-
    mixed: 0); ``output_tokens`` is forced (max_tokens, EOS ignored), always >= 1."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    source: str
    window: int = 0
