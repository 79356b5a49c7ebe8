"""Per-request latencies, SLO attainment and time series of one simulated run.

Paper definitions (§V-A): TTFT = first token time − arrival; TPOT = (last token time − first
token time) / (output_tokens − 1) (0 for a one-token output); a request attains the TTFT
(TPOT) SLO when its TTFT (TPOT) is at most the SLO, and the joint SLO when it attains both.
A failed request (admission given up, prompt over the context) attains neither; so does a
request shed at the router (``rejected``) or dropped from a prefill queue past its deadline
(``expired``), which are also counted separately.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.sim.workers import SimRequest

INF = math.inf


@dataclass
class SimResult:
    """Outcome of one run (or, for the oracle, of several runs stitched by window)."""

    label: str
    arrival_s: list[float]
    ttft_s: list[float]
    tpot_s: list[float]
    window: list[int]
    source: list[str]
    failed: list[bool]
    rejected: list[bool] = field(default_factory=list)
    expired: list[bool] = field(default_factory=list)
    switches: list[dict[str, Any]] = field(default_factory=list)
    stolen_tokens: int = 0
    split_requests: int = 0
    refused_steals: int = 0
    migrations: int = 0
    series: dict[str, list[float]] = field(default_factory=dict)
    sim_time_s: float = 0.0
    wall_s: float = 0.0
    events: int = 0
    notes: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_requests(
        cls,
        label: str,
        reqs: Sequence[SimRequest],
        *,
        switches: list[dict[str, Any]],
        stolen_tokens: int,
        split_requests: int,
        refused_steals: int,
        migrations: int,
        series: dict[str, list[float]],
        sim_time_s: float,
        wall_s: float,
        events: int,
    ) -> SimResult:
        """The result of a finished run: per-request latencies from ``reqs`` (in order), the
        run's counters as given. Copies ``switches``; mutates nothing."""
        ttft, tpot = [], []
        for r in reqs:
            if r.failed or r.t_first < 0:
                ttft.append(INF)
                tpot.append(INF)
                continue
            ttft.append(r.t_first - r.arrival_s)
            tpot.append((r.t_last - r.t_first) / (r.output - 1) if r.output > 1 else 0.0)
        return cls(
            label=label,
            arrival_s=[r.arrival_s for r in reqs],
            ttft_s=ttft,
            tpot_s=tpot,
            window=[r.window for r in reqs],
            source=[r.source for r in reqs],
            failed=[r.failed for r in reqs],
            rejected=[r.rejected for r in reqs],
            expired=[r.expired for r in reqs],
            switches=list(switches),
            stolen_tokens=stolen_tokens,
            split_requests=split_requests,
            refused_steals=refused_steals,
            migrations=migrations,
            series=series,
            sim_time_s=sim_time_s,
            wall_s=wall_s,
            events=events,
        )

    @property
    def count(self) -> int:
        return len(self.ttft_s)

    def attainment(
        self, ttft_slo_s: float, tpot_slo_s: float, window: int | None = None
    ) -> dict[str, float | int]:
        """Fractions (0..1) of requests (of ``window`` only, if given) meeting each SLO, and
        ``tpot_missed_after_ttft``: how many met the TTFT SLO but not the TPOT one (in the
        disaggregated data path mostly a wait for a decode slot after the first token)."""
        n = ok_t = ok_p = ok_j = failed = 0
        for i, ttft in enumerate(self.ttft_s):
            if window is not None and self.window[i] != window:
                continue
            n += 1
            a = ttft <= ttft_slo_s
            b = self.tpot_s[i] <= tpot_slo_s
            ok_t += a
            ok_p += b
            ok_j += a and b
            failed += self.failed[i]
        return {
            "requests": n,
            "ttft_attainment": ok_t / n if n else 0.0,
            "tpot_attainment": ok_p / n if n else 0.0,
            "joint_attainment": ok_j / n if n else 0.0,
            "failed": failed,
            "tpot_missed_after_ttft": ok_t - ok_j,
        }

    def windows(self) -> list[int]:
        return sorted(set(self.window))

    def p95_ttft_per_s(self) -> tuple[list[int], list[float]]:
        """p95 TTFT (s; inf for failed) of the requests arriving in each whole second."""
        buckets: dict[int, list[float]] = {}
        for arr, ttft in zip(self.arrival_s, self.ttft_s, strict=True):
            buckets.setdefault(int(arr), []).append(ttft)
        secs = sorted(buckets)
        out = []
        for s in secs:
            vals = sorted(buckets[s])
            out.append(vals[max(0, math.ceil(0.95 * len(vals)) - 1)])
        return secs, out

    def summary(self, ttft_slo_s: float, tpot_slo_s: float) -> dict[str, Any]:
        """Overall and per-window attainment plus the mechanism counters (JSON-ready)."""
        out: dict[str, Any] = dict(self.attainment(ttft_slo_s, tpot_slo_s))
        out["per_window"] = {
            str(w): self.attainment(ttft_slo_s, tpot_slo_s, w) for w in self.windows()
        }
        n_rej, n_exp = sum(self.rejected), sum(self.expired)
        out.update(
            failed=out["failed"] - n_rej - n_exp,
            rejected=n_rej,
            expired=n_exp,
            switches=sum(1 for s in self.switches if not s.get("cancelled")),
            cancelled_switches=sum(1 for s in self.switches if s.get("cancelled")),
            stolen_tokens=self.stolen_tokens,
            split_requests=self.split_requests,
            refused_steals=self.refused_steals,
            migrations=self.migrations,
            sim_time_s=round(self.sim_time_s, 3),
            wall_s=round(self.wall_s, 3),
            events=self.events,
        )
        if self.notes:
            out["notes"] = self.notes
        return out

    def to_json_dict(self, ttft_slo_s: float, tpot_slo_s: float) -> dict[str, Any]:
        """Summary, switch log and time series (per-second p95 TTFT in ms; inf → null)."""
        secs, p95 = self.p95_ttft_per_s()
        return {
            "label": self.label,
            "summary": self.summary(ttft_slo_s, tpot_slo_s),
            "switch_log": self.switches,
            "series": {
                **{k: [round(v, 3) for v in vals] for k, vals in self.series.items()},
                "p95_ttft_ms_by_arrival_s": {
                    "t_s": secs,
                    "p95_ttft_ms": [None if math.isinf(v) else round(v * 1e3, 1) for v in p95],
                },
            },
        }


def stitch(label: str, parts: list[SimResult], notes: dict[str, Any]) -> SimResult:
    """One result from per-window runs (the oracle): requests concatenated in order."""
    out = SimResult(label, [], [], [], [], [], [], notes=notes)
    for p in parts:
        out.arrival_s += p.arrival_s
        out.ttft_s += p.ttft_s
        out.tpot_s += p.tpot_s
        out.window += p.window
        out.source += p.source
        out.failed += p.failed
        out.rejected += p.rejected
        out.expired += p.expired
        out.stolen_tokens += p.stolen_tokens
        out.sim_time_s = max(out.sim_time_s, p.sim_time_s)
        out.wall_s += p.wall_s
        out.events += p.events
    return out
