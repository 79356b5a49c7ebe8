"""Azure trace workloads (FluidPD paper §III-A, §V-A): ``azure-staged`` and ``azure-mixed``.

Pure Python (no torch, no numpy), deterministic: the same arguments give the same list.

* ``azure-staged`` — the paper's sustained shift (§V-A: "30K requests arranged as three 10K-
  request stages: Azure-conversation, Azure-code, and Azure-conversation"): stage 0 is the
  first ``STAGE_REQUESTS`` conversation requests at or after ``trace_offset_s`` into that
  trace, stage 1 the first ``STAGE_REQUESTS`` code requests at or after ``trace_offset_s``
  into the code trace, stage 2 the next ``STAGE_REQUESTS`` conversation requests after stage
  0 (consecutive, non-overlapping: no request is replayed twice). The shipped traces hold
  8,819 code and 19,366 conversation requests, so from offset 0 the stages hold 10,000 /
  8,819 / 9,366 requests (28,185 in all): the two later stages are as long as the traces
  allow. With ``rps`` set, arrivals are a constant-rate Poisson process at ``rps`` over the
  whole workload (§III-A: "a constant 40 RPS Poisson arrival rate"); the trace contributes
  the request mix and lengths, not its timing. Without ``rps`` (and ``arrival``) each stage
  keeps its trace's own inter-arrival times, stages back to back.
* ``azure-mixed`` — the paper's transient bursts (§V-A: "10K naturally interleaved requests
  from a bursty trace window"): both traces merged on their common clock (both were recorded
  on the same afternoon) by real arrival time, the first ``MIXED_REQUESTS`` at or after
  ``trace_offset_s``; ``rps`` scales the trace's inter-arrival times so the mean rate is
  ``rps`` (the trace's burst structure is what this workload is about).

``arrival`` overrides the default timing of either workload: ``"poisson"`` (seeded by
``seed``) or ``"trace"`` (the trace's inter-arrival times, scaled to ``rps``; for azure-staged
each stage is scaled to ``rps`` on its own: the timing of the first, time-window-based
construction, applied to these stages).

Knobs, applied in this order: stage/window selection → ``requests`` (truncate: azure-staged
keeps the first ``requests // 3`` of each stage, azure-mixed the first ``requests``) →
arrival times at ``rps`` → ``time_scale`` (multiplies every arrival time: < 1 compresses
time) → ``max_prompt_tokens`` (clips prompt lengths to a context limit). The first request
arrives at 0.
"""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import date
from importlib import resources
from typing import Any

from shared.errors import InvalidRequestError
from shared.trace_request import TraceRequest

CODE = "code"
CONVERSATION = "conversation"
TRACE_FILES = {CODE: "azure_code_2023.csv", CONVERSATION: "azure_conv_2023.csv"}
STAGED = "azure-staged"
MIXED = "azure-mixed"
WORKLOADS = (STAGED, MIXED)
STAGED_SOURCES = (CONVERSATION, CODE, CONVERSATION)
STAGE_REQUESTS = 10_000  # §V-A: three 10K-request stages
MIXED_REQUESTS = 10_000  # §V-A: 10K interleaved requests
POISSON = "poisson"
TRACE = "trace"
ARRIVALS = (POISSON, TRACE)
DEFAULT_ARRIVAL = {STAGED: POISSON, MIXED: TRACE}


class WorkloadError(InvalidRequestError):
    """A workload cannot be built from these arguments (unknown name, window outside the
    trace, non-positive rate...)."""

    code = "invalid_workload"


def window_of(request: TraceRequest) -> str:
    """Label of the stage a request belongs to, e.g. ``"0:conversation"`` (for per-window
    results). azure-mixed requests are all in window 0 and keep their source in the label."""
    return f"{request.window}:{request.source}"


def _parse_timestamp_s(text: str) -> float:
    """'2023-11-16 18:17:03.9799600' → seconds since 0001-01-01 (7 fractional digits are
    more than datetime.strptime accepts, so it is split by hand)."""
    day, clock = text.strip().split(" ")
    y, mo, d = (int(x) for x in day.split("-"))
    h, mi, s = clock.split(":")
    return date(y, mo, d).toordinal() * 86400.0 + int(h) * 3600 + int(mi) * 60 + float(s)


def load_trace(source: str) -> list[TraceRequest]:
    """The whole trace ``source`` (CODE or CONVERSATION) in file order, arrival_s in absolute
    seconds (see ``_parse_timestamp_s``). Reads the packaged CSV. Raises WorkloadError."""
    name = TRACE_FILES.get(source)
    if name is None:
        raise WorkloadError(f"unknown trace source {source!r}; known: {sorted(TRACE_FILES)}")
    text = resources.files("services.bench.traces").joinpath(name).read_text(encoding="utf-8")
    lines = text.splitlines()
    if not lines or lines[0].strip() != "TIMESTAMP,ContextTokens,GeneratedTokens":
        raise WorkloadError(f"{name}: unexpected header {lines[:1]!r}")
    out = []
    for lineno, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            ts, ctx, gen = line.split(",")
            out.append(
                TraceRequest(_parse_timestamp_s(ts), max(1, int(ctx)), max(1, int(gen)), source)
            )
        except ValueError as exc:
            raise WorkloadError(f"{name}:{lineno}: malformed row {line!r}") from exc
    out.sort(key=lambda r: r.arrival_s)  # stable: equal timestamps keep file order
    return out


def _from_offset(trace: list[TraceRequest], origin_s: float, offset_s: float) -> int:
    """Index of the first request of ``trace`` at or after ``origin_s + offset_s``."""
    t = origin_s + offset_s
    return next((i for i, r in enumerate(trace) if r.arrival_s >= t), len(trace))


def _rebase(reqs: list[TraceRequest], start_s: float, rps: float | None) -> list[TraceRequest]:
    """Shift ``reqs`` to begin at ``start_s``; with ``rps``, scale the gaps so the mean rate
    over the window (n requests in n/rps seconds: one mean gap per request) is ``rps``."""
    first = reqs[0].arrival_s
    span = reqs[-1].arrival_s - first
    factor = 1.0
    if rps is not None:
        # n requests at mean rate rps span (n-1)/rps between first and last arrival.
        target = (len(reqs) - 1) / rps
        factor = target / span if span > 0 else 0.0
    return [replace(r, arrival_s=start_s + (r.arrival_s - first) * factor) for r in reqs]


def _poisson(reqs: list[TraceRequest], rps: float, seed: int) -> list[TraceRequest]:
    """Arrival times of a Poisson process at ``rps`` (first at 0), in ``reqs``' order."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for i, r in enumerate(reqs):
        if i:
            t += rng.expovariate(rps)
        out.append(replace(r, arrival_s=t))
    return out


def _staged(
    traces: dict[str, list[TraceRequest]], per_stage: int, offset_s: float
) -> list[list[TraceRequest]]:
    """The three stages (module doc), trace timestamps kept. Raises WorkloadError."""
    stages = []
    next_index: dict[str, int] = {}  # per source: where its next stage starts
    for index, source in enumerate(STAGED_SOURCES):
        trace = traces[source]
        start = next_index.get(source)
        if start is None:
            start = _from_offset(trace, trace[0].arrival_s, offset_s)
        stage = [replace(r, window=index) for r in trace[start : start + per_stage]]
        if not stage:
            raise WorkloadError(
                f"stage {index} ({source}) is empty: the {source} trace has {len(trace)} "
                f"requests, {start} of them before this stage; lower trace_offset_s"
            )
        next_index[source] = start + len(stage)
        stages.append(stage)
    return stages


def build_workload(
    name: str,
    *,
    rps: float | None = None,
    requests: int | None = None,
    trace_offset_s: float = 0.0,
    arrival: str | None = None,
    seed: int = 0,
    time_scale: float = 1.0,
    max_prompt_tokens: int | None = None,
) -> list[TraceRequest]:
    """Build workload ``name`` (see module doc), sorted by arrival. Raises WorkloadError."""
    if name not in WORKLOADS:
        raise WorkloadError(f"unknown workload {name!r}; known: {list(WORKLOADS)}")
    if rps is not None and not rps > 0:
        raise WorkloadError("rps must be > 0")
    if requests is not None and requests < (3 if name == STAGED else 1):
        raise WorkloadError("requests must be >= 1 (>= 3 for azure-staged)")
    if trace_offset_s < 0 or not time_scale > 0:
        raise WorkloadError("trace_offset_s >= 0 and time_scale > 0 required")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise WorkloadError("max_prompt_tokens must be >= 1")
    # Without a rate there is no Poisson process to draw: the trace's own timing.
    arrival = arrival or (DEFAULT_ARRIVAL[name] if rps is not None else TRACE)
    if arrival not in ARRIVALS:
        raise WorkloadError(f"arrival must be one of {list(ARRIVALS)}")
    if arrival == POISSON and rps is None:
        raise WorkloadError("poisson arrivals need rps")
    traces = {s: load_trace(s) for s in TRACE_FILES}
    out: list[TraceRequest] = []
    if name == STAGED:
        per_stage = STAGE_REQUESTS if requests is None else requests // 3
        stages = _staged(traces, per_stage, trace_offset_s)
        if arrival == POISSON:
            assert rps is not None
            out = _poisson([r for stage in stages for r in stage], rps, seed)
        else:
            t_next = 0.0
            for stage in stages:
                stage = _rebase(stage, t_next, rps)
                # The next stage starts one mean gap after this one's last arrival.
                gap = 1.0 / rps if rps is not None else _mean_gap(stage)
                t_next = stage[-1].arrival_s + gap
                out.extend(stage)
    else:
        origin = min(traces[CODE][0].arrival_s, traces[CONVERSATION][0].arrival_s)
        # Interleave by real arrival; ties keep conversation first (deterministic).
        merged = sorted([*traces[CONVERSATION], *traces[CODE]], key=lambda r: r.arrival_s)
        start = _from_offset(merged, origin, trace_offset_s)
        merged = merged[start : start + (MIXED_REQUESTS if requests is None else requests)]
        if not merged:
            raise WorkloadError(f"no requests at or after {trace_offset_s} s of the traces")
        if arrival == POISSON:
            assert rps is not None
            out = _poisson(merged, rps, seed)
        else:
            out = _rebase(merged, 0.0, rps)
    if time_scale != 1.0:
        out = [replace(r, arrival_s=r.arrival_s * time_scale) for r in out]
    if max_prompt_tokens is not None:
        out = [
            replace(r, prompt_tokens=max_prompt_tokens)
            if r.prompt_tokens > max_prompt_tokens
            else r
            for r in out
        ]
    return out


def _mean_gap(reqs: list[TraceRequest]) -> float:
    if len(reqs) < 2:
        return 1.0
    return (reqs[-1].arrival_s - reqs[0].arrival_s) / (len(reqs) - 1)


def mean_rate_rps(reqs: list[TraceRequest]) -> float:
    """Requests per second over the span of ``reqs`` ((n-1) gaps between first and last)."""
    if len(reqs) < 2:
        return 0.0
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    return (len(reqs) - 1) / span if span > 0 else float("inf")


def workload_from_args(
    args: Any, rps: float, *, time_scale: float = 1.0, max_prompt_tokens: int | None = None
) -> list[TraceRequest]:
    """``build_workload`` from the flags ``bench sim``, ``bench replay`` and the cross-check
    share (``--workload --requests --trace-offset --arrival --seed``). Raises WorkloadError."""
    return build_workload(
        args.workload,
        rps=rps,
        requests=args.requests,
        trace_offset_s=args.trace_offset,
        arrival=args.arrival,
        seed=args.seed,
        time_scale=time_scale,
        max_prompt_tokens=max_prompt_tokens,
    )
