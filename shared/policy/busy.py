"""How busy a prefill engine has been: the fraction of the last window it spent computing.

FluidRole bounds a prefill→decode move by it (shared/policy/fluidrole_sizing.py): PPI (eq. 5)
is a queue measure — near 0 whenever the queue happens to be empty — so it cannot say how
much prefill capacity the arrivals use, and a P→D move sized on it starved prefill on a
steady overload. The busy fraction can: moving k of |P| workers raises it, to first order,
by |P| / (|P| − k).

The owner (the prefill worker, or the simulated one) keeps a running total of seconds spent
computing (``BusyClock``, bracketing each step) and samples it every telemetry tick into a
``BusyMeter``; ``fraction`` is the slope of that total over the window. Pure: the caller
passes every timestamp (seconds, any monotonic origin).
"""

from __future__ import annotations

from collections import deque

from shared.policy.errors import PolicyConfigError


class BusyClock:
    """Running total of busy seconds: ``start`` / ``stop`` bracket each busy period (one at
    a time); ``total_s`` counts the open period's share too. Mutable; not thread-safe."""

    def __init__(self) -> None:
        self._done_s = 0.0
        self._started_s: float | None = None

    def start(self, now_s: float) -> None:
        """A busy period begins at ``now_s``. Mutates."""
        self._started_s = now_s

    def stop(self, now_s: float) -> None:
        """The open busy period ends at ``now_s`` (no-op if none is open). Mutates."""
        if self._started_s is not None:
            self._done_s += now_s - self._started_s
            self._started_s = None

    def total_s(self, now_s: float) -> float:
        """Busy seconds up to ``now_s``, the open period's share included."""
        started = self._started_s
        return self._done_s + (now_s - started if started is not None else 0.0)


class BusyMeter:
    """Samples (t, busy_total_s) of the last ``window_s`` seconds. Mutable; not thread-safe."""

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise PolicyConfigError("window_s must be > 0")
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()

    def sample(self, now_s: float, busy_total_s: float) -> None:
        """Record the running total at ``now_s`` (it must not decrease). Mutates."""
        samples = self._samples
        samples.append((now_s, busy_total_s))
        # Keep one sample at or before the window's start, so the slope spans the window.
        while len(samples) > 2 and samples[1][0] <= now_s - self.window_s:
            samples.popleft()

    def clear(self) -> None:
        """Forget every sample (the worker left the prefill role). Mutates."""
        self._samples.clear()

    def fraction(self) -> float:
        """Busy seconds per second over the window, in [0, 1]; 0.0 before two samples."""
        if len(self._samples) < 2:
            return 0.0
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        if t1 <= t0:
            return 0.0
        return min(1.0, max(0.0, (b1 - b0) / (t1 - t0)))
