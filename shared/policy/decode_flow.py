"""The decode backlog to come, by Little's law.

FluidRole's D→P bound reads the decode backlog *now* (running decodes + requests waiting for
decode admission). Early in a load step that understates what decode will have to carry:
the requests entering decode have not been there long enough to pile up, so a D→P move
looks safe, and a decode lifetime later the remaining decode workers are the bottleneck
(docs/results.md, Session 12).

The steady-state backlog of the flow entering decode now is L = λ_in · W (Little's law),
W the mean time a request stays. Over a window, W = ∫N dt / departures (every resident's
time counts, also that of requests not finished yet: a mean over the finished ones alone is
biased to the short requests early in a ramp), so L = N̄ · λ_in / λ_out — the mean backlog
over the window scaled by how much faster requests enter decode than they leave it. In a
steady state the ratio is 1 and L = N̄; while decode fills, L > N̄.

While decode drains (λ_in < λ_out) the forecast is capped at the backlog now: the backlog
is falling, and N̄ still holds the window's earlier, larger backlog. Without the cap, at a
stage edge from conversation to code the forecast kept the conversation stage's decode
backlog for a whole window and held the first D→P move to one worker, then a settle, while
the code stage's prefill queue grew (docs/results.md, Session 17).

Inputs: every worker's cumulative counters ``decode_entered_total`` and ``decode_left_total``
(telemetry metrics: a request enters when its KV is installed, by a prefill hand-off or a
migration, and leaves when it finishes, is cancelled or migrates away) and the backlog N at
each sample. The meter sums each worker's increments (a restarted worker's counters start
again at 0: its negative step reads as 0), so a worker that changes role keeps its history.
``RolePolicy`` owns the meter (as it owns its DPI̅_adm window) and feeds it from each
decision's ``WorkerView.decode_counters``. Pure: the caller passes every timestamp.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from shared.policy.errors import PolicyConfigError

MAX_FLOW_RATIO = 4.0  # λ_in / λ_out is capped here (and assumed when nothing left yet)


@dataclass(frozen=True, slots=True)
class DecodeFlow:
    """Over the window: requests that entered and left decode, and the mean backlog N̄."""

    entered: float = 0.0
    left: float = 0.0
    mean_backlog: float = 0.0
    max_ratio: float = MAX_FLOW_RATIO
    backlog_now: float | None = None  # the backlog at the window's last sample

    @property
    def requests(self) -> float:
        """The forecast backlog N̄ · λ_in / λ_out; the ratio is capped at ``max_ratio`` (also
        when nothing left yet: then decode is filling at an unknown rate). While decode
        drains (more left than entered) the backlog falls, so the forecast is at most the
        backlog now: N̄ still carries the window's earlier, larger backlog."""
        if self.entered <= 0:
            forecast = self.mean_backlog
        else:
            ratio = self.entered / self.left if self.left > 0 else self.max_ratio
            forecast = self.mean_backlog * min(max(ratio, 0.0), self.max_ratio)
        if self.backlog_now is not None and self.left > self.entered:
            return min(forecast, self.backlog_now)
        return forecast


@dataclass(frozen=True, slots=True)
class FlowCounters:
    """One worker's cumulative decode counters as published (monotonic within a process)."""

    entered: float = 0.0
    left: float = 0.0


class DecodeFlowMeter:
    """Sums the workers' counter increments and windows them. Mutable; not thread-safe."""

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise PolicyConfigError("decode flow window_s must be > 0")
        self.window_s = window_s
        self._last: dict[str, FlowCounters] = {}
        # (time, cumulative entered, cumulative left, backlog then) per sample.
        self._samples: deque[tuple[float, float, float, float]] = deque()
        self._entered = self._left = 0.0

    def observe(self, worker_id: str, counters: FlowCounters) -> None:
        """Add ``worker_id``'s increments since its last report (mutates the totals)."""
        prev = self._last.get(worker_id)
        self._last[worker_id] = counters
        if prev is None:
            # A worker's first report carries its past, not this window's flow: it only
            # sets the baseline.
            return
        self._entered += max(0.0, counters.entered - prev.entered)
        self._left += max(0.0, counters.left - prev.left)

    def sample(self, now_s: float, backlog: float) -> DecodeFlow:
        """Record the totals and the backlog at ``now_s``; the flow over the last
        ``window_s`` (the oldest sample kept is the window's start)."""
        samples = self._samples
        samples.append((now_s, self._entered, self._left, backlog))
        while len(samples) > 2 and samples[1][0] <= now_s - self.window_s:
            samples.popleft()
        _, e0, l0, _ = samples[0]
        mean_backlog = sum(s[3] for s in samples) / len(samples)
        return DecodeFlow(self._entered - e0, self._left - l0, mean_backlog, backlog_now=backlog)
