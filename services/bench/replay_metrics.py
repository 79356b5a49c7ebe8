"""Per-run measurements of ``fluidpd bench replay``: attainment (overall and per window),
per-request JSON lines, and whether the load generator / router is the bottleneck.

All latencies in the records are real (wall) seconds of the run; attainment is computed
against the SLOs multiplied by the time scale (the caller passes the scaled SLOs), which is
the same as comparing trace-time latencies (real / scale) with the unscaled SLOs.

Bottleneck evidence (``loadgen_bottleneck``):

* ``dispatch_lag_ms`` — how late each request left the client vs its scheduled arrival. An
  open-loop generator that keeps up has a lag of ~1 ms; a starved event loop lags.
* ``client_minus_server_first_token_ms`` — client receive time of the first SSE chunk minus
  the router's receive time of that token (``fluidpd_timestamps``): time spent in the router's
  HTTP path and the client's parsing. Large values mean attainment measured at the client
  would be worse than what the serving system delivered.
* ``ttft_attainment_client`` — attainment recomputed from client chunk times only.
* CPU: the load generator process's CPU seconds / wall seconds (1.0 = one core saturated),
  the router's and the whole machine's (/proc/stat; 1.0 = every core busy).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any

from services.bench.loadgen import RequestRecord, summarize


def pct(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile ``q`` in [0, 1] of ``values`` (None when empty)."""
    xs = sorted(values)
    if not xs:
        return None
    return xs[max(0, min(len(xs) - 1, math.ceil(q * len(xs)) - 1))]


def record_json(rec: RequestRecord, time_scale: float) -> dict[str, Any]:
    """One JSON line: the loadgen record plus client-side first/last chunk times and the
    latencies in trace milliseconds (real / time_scale)."""
    d = rec.to_json()
    d["client_first_chunk_s"] = rec.chunk_times_s[0] if rec.chunk_times_s else None
    d["client_last_chunk_s"] = rec.chunk_times_s[-1] if rec.chunk_times_s else None
    d["server_times"] = bool(rec.server_token_times_s)
    d["ttft_trace_ms"] = None if rec.ttft_s is None else round(rec.ttft_s / time_scale * 1e3, 3)
    d["tpot_trace_ms"] = None if rec.tpot_s is None else round(rec.tpot_s / time_scale * 1e3, 3)
    return d


def outcome_counts(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """How the requests that did not complete ended: ``rejected`` — answered 503 before any
    200 (shed at the router for a hopeless predicted TTFT, or dropped from a prefill queue
    past its deadline; they count as not attained) — and ``failed_after_accept`` — a 200
    whose stream then ended in an error (what a serving system must not do). Counts and
    fractions of all requests."""
    n = len(records)
    rejected = sum(1 for r in records if r.status == 503)
    failed = sum(1 for r in records if r.status == 200 and r.error is not None)
    return {
        "rejected": rejected,
        "rejected_fraction": round(rejected / n, 4) if n else 0.0,
        "failed_after_accept": failed,
        "failed_after_accept_fraction": round(failed / n, 4) if n else 0.0,
    }


def attainment(
    records: Sequence[RequestRecord], slo_ttft_ms: float, slo_tpot_ms: float
) -> dict[str, Any]:
    """``loadgen.summarize`` plus rejected / failed-after-accept counts (``outcome_counts``)
    and per-window joint attainment (windows = record labels)."""
    out = summarize(records, slo_ttft_ms, slo_tpot_ms)
    out.update(outcome_counts(records))
    labels = sorted({r.label for r in records})
    out["per_window"] = {
        lab: summarize([r for r in records if r.label == lab], slo_ttft_ms, slo_tpot_ms)[
            "joint_attainment"
        ]
        for lab in labels
    }
    return out


def p95_ttft_series(
    records: Sequence[RequestRecord], time_scale: float
) -> dict[str, list[float | None]]:
    """p95 TTFT (trace ms; None when a request of that second failed to get a first token
    and is in the top 5 %) of the requests arriving in each whole trace second."""
    buckets: dict[int, list[float]] = {}
    for r in records:
        ttft = math.inf if r.ttft_s is None or r.error else r.ttft_s / time_scale
        buckets.setdefault(int(r.arrival_s / time_scale), []).append(ttft)
    secs = sorted(buckets)
    vals: list[float | None] = []
    for s in secs:
        v = pct(buckets[s], 0.95)
        vals.append(None if v is None or math.isinf(v) else round(v * 1e3, 1))
    return {"t_s": [float(s) for s in secs], "p95_ttft_ms": vals}


def client_attainment(records: Sequence[RequestRecord], slo_ttft_ms: float) -> float:
    """TTFT attainment from client chunk receive times alone."""
    n = len(records)
    ok = sum(
        1
        for r in records
        if r.error is None
        and r.chunk_times_s
        and (r.chunk_times_s[0] - r.arrival_s) * 1e3 <= slo_ttft_ms
    )
    return round(ok / n, 4) if n else 0.0


class CpuMeter:
    """CPU seconds of this process, of given pids (/proc/PID/stat) and of the machine
    (/proc/stat) between ``__init__`` and ``read()``. Linux only; missing files read as 0."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
        self.t0 = time.monotonic()
        self.self0 = time.process_time()
        self.pid0 = {name: self._pid_cpu(pid) for name, pid in pids.items()}
        self.sys0 = self._machine()

    def _pid_cpu(self, pid: int) -> float:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            # utime, stime, cutime, cstime: fields 14-17 (1-based), 12-15 after the comm.
            return sum(int(x) for x in fields[11:15]) * self.tick_s
        except (OSError, IndexError, ValueError):
            return 0.0

    def _machine(self) -> tuple[float, float]:
        try:
            with open("/proc/stat", encoding="ascii") as f:
                parts = [int(x) for x in f.readline().split()[1:]]
            idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
            return (sum(parts) - idle) * self.tick_s, sum(parts) * self.tick_s
        except (OSError, ValueError, IndexError):
            return 0.0, 0.0

    def read(self) -> dict[str, Any]:
        wall = max(1e-9, time.monotonic() - self.t0)
        busy1, total1 = self._machine()
        busy0, total0 = self.sys0
        out: dict[str, Any] = {
            "wall_s": round(wall, 2),
            "loadgen_cpu_cores": round((time.process_time() - self.self0) / wall, 3),
            "machine_cpu_busy_fraction": round((busy1 - busy0) / (total1 - total0), 3)
            if total1 > total0
            else None,
            "machine_cores": os.cpu_count(),
        }
        for name, pid in self.pids.items():
            out[f"{name}_cpu_cores"] = round((self._pid_cpu(pid) - self.pid0[name]) / wall, 3)
        return out


def bottleneck(
    records: Sequence[RequestRecord], cpu: dict[str, Any], slo_ttft_ms: float, time_scale: float
) -> dict[str, Any]:
    """The ``loadgen_bottleneck`` section (module doc) and a one-line verdict."""
    lag = [(r.sent_s - r.arrival_s) * 1e3 for r in records]
    gap = [
        (r.chunk_times_s[0] - r.server_token_times_s[0]) * 1e3
        for r in records
        if r.chunk_times_s and r.server_token_times_s
    ]
    server_att = summarize(records, slo_ttft_ms, 1e18)["ttft_attainment"]
    client_att = client_attainment(records, slo_ttft_ms)

    def r3(x: float | None) -> float | None:
        return None if x is None else round(x, 3)

    out: dict[str, Any] = {
        "dispatch_lag_ms": {
            "p50": r3(pct(lag, 0.5)),
            "p99": r3(pct(lag, 0.99)),
            "max": r3(max(lag, default=None)),
        },
        "client_minus_server_first_token_ms": {
            "p50": r3(pct(gap, 0.5)),
            "p95": r3(pct(gap, 0.95)),
            "max": r3(max(gap, default=None)),
            "sampled": len(gap),
        },
        "ttft_attainment_server": server_att,
        "ttft_attainment_client": client_att,
        **cpu,
    }
    # The client is a bottleneck when it delays what it measures by a noticeable part of
    # the SLO (5 %), or when it holds a whole core.
    limit_ms = 0.05 * slo_ttft_ms
    p99_lag = pct(lag, 0.99) or 0.0
    p95_gap = pct(gap, 0.95) or 0.0
    reasons = []
    if p99_lag > limit_ms:
        reasons.append(f"dispatch lag p99 {p99_lag:.1f} ms > {limit_ms:.1f} ms")
    if p95_gap > limit_ms:
        reasons.append(f"client-server first-token gap p95 {p95_gap:.1f} ms > {limit_ms:.1f} ms")
    if cpu.get("loadgen_cpu_cores", 0.0) > 0.8:
        reasons.append("load generator uses > 0.8 of a core")
    if (cpu.get("machine_cpu_busy_fraction") or 0.0) > 0.9:
        reasons.append("machine CPU > 90 % busy (emulated timings stretch)")
    out["verdict"] = "; ".join(reasons) if reasons else "not a bottleneck"
    out["time_scale"] = time_scale
    return out
