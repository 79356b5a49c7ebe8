"""Azure trace workloads (FluidPD paper §III-A, §V-A): ``azure-staged`` and ``azure-mixed``.

Pure Python (no torch, no numpy), deterministic: the same arguments give the same list.

* ``azure-staged`` — the paper's sustained shift: three windows back to back, Azure-
  conversation → Azure-code → Azure-conversation. Each window holds the requests that arrive
  within ``window_s`` seconds of trace time, starting ``trace_offset_s`` into its trace; the
  two conversation windows are consecutive, non-overlapping segments of the conversation
  trace (so no request is replayed twice). With ``rps`` set, each window's inter-arrival
  times are scaled so that window's mean rate is ``rps`` (a constant offered rate, as in the
  paper, with the trace's burst structure kept inside each window).
* ``azure-mixed`` — both traces over one window (``trace_offset_s`` .. + ``window_s`` of the
  common clock: both traces were recorded on the same afternoon), interleaved by their real
  arrival times; ``rps`` scales the merged window to that mean rate.

Knobs, applied in this order: window selection → ``requests`` (truncate: azure-staged keeps
the first ``requests // 3`` of each window, azure-mixed the first ``requests``) → ``rps`` →
``time_scale`` (multiplies every arrival time: < 1 compresses time) → ``max_prompt_tokens``
(clips prompt lengths to a context limit). The first request of the workload arrives at 0.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import date
from importlib import resources

from shared.errors import InvalidRequestError

CODE = "code"
CONVERSATION = "conversation"
TRACE_FILES = {CODE: "azure_code_2023.csv", CONVERSATION: "azure_conv_2023.csv"}
STAGED = "azure-staged"
MIXED = "azure-mixed"
WORKLOADS = (STAGED, MIXED)
STAGED_SOURCES = (CONVERSATION, CODE, CONVERSATION)
DEFAULT_WINDOW_S = 600.0


class WorkloadError(InvalidRequestError):
    """A workload cannot be built from these arguments (unknown name, window outside the
    trace, non-positive rate...)."""

    code = "invalid_workload"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request to replay. ``window`` is the stage index (azure-staged: 0, 1, 2; azure-
    mixed: 0); ``output_tokens`` is forced (max_tokens, EOS ignored), always >= 1."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    source: str
    window: int = 0


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


def _window(
    trace: list[TraceRequest],
    origin_s: float,
    start_s: float,
    window_s: float,
    index: int,
    allow_empty: bool = False,
) -> list[TraceRequest]:
    lo, hi = origin_s + start_s, origin_s + start_s + window_s
    if trace and hi > trace[-1].arrival_s + 1.0:
        # A window running past the trace's end would silently hold fewer requests.
        raise WorkloadError(
            f"window [{start_s}, {start_s + window_s}) s runs past the end of the "
            f"{trace[0].source} trace ({trace[-1].arrival_s - origin_s:.0f} s)"
        )
    picked = [replace(r, window=index) for r in trace if lo <= r.arrival_s < hi]
    if not picked and not allow_empty:
        raise WorkloadError(
            f"no {trace[0].source if trace else ''} requests in [{start_s}, {start_s + window_s}) "
            "s of the trace; lower trace_offset_s or window_s"
        )
    return picked


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


def build_workload(
    name: str,
    *,
    rps: float | None = None,
    requests: int | None = None,
    trace_offset_s: float = 0.0,
    window_s: float = DEFAULT_WINDOW_S,
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
    if trace_offset_s < 0 or not window_s > 0 or not time_scale > 0:
        raise WorkloadError("trace_offset_s >= 0, window_s > 0 and time_scale > 0 required")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise WorkloadError("max_prompt_tokens must be >= 1")
    traces = {s: load_trace(s) for s in TRACE_FILES}
    out: list[TraceRequest] = []
    if name == STAGED:
        conv_offset = trace_offset_s
        t_next = 0.0
        for index, source in enumerate(STAGED_SOURCES):
            trace = traces[source]
            start = trace_offset_s
            if source == CONVERSATION:
                start, conv_offset = conv_offset, conv_offset + window_s
            stage = _window(trace, trace[0].arrival_s, start, window_s, index)
            if requests is not None:
                stage = stage[: requests // 3]
            stage = _rebase(stage, t_next, rps)
            # The next stage starts one mean gap after this one's last arrival.
            gap = 1.0 / rps if rps is not None else _mean_gap(stage)
            t_next = stage[-1].arrival_s + gap
            out.extend(stage)
    else:
        origin = min(traces[CODE][0].arrival_s, traces[CONVERSATION][0].arrival_s)
        merged = [
            *_window(traces[CONVERSATION], origin, trace_offset_s, window_s, 0, True),
            *_window(traces[CODE], origin, trace_offset_s, window_s, 0, True),
        ]
        if not merged:
            raise WorkloadError(f"no requests in [{trace_offset_s}, +{window_s}) s")
        # Interleave by real arrival; ties keep conversation first (deterministic).
        merged.sort(key=lambda r: r.arrival_s)
        if requests is not None:
            merged = merged[:requests]
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
