"""Sliding time windows with a percentile, for FluidRole's PPI^95(p) (paper eq. 20).

The controller keeps one window per prefill worker, adds each published queue-level PPI
(eq. 5) with its timestamp, and asks for the p95 at decision time. Pure data structures:
the caller passes every timestamp (seconds, any monotonic origin).
"""

from __future__ import annotations

import math
from collections import deque

from shared.policy.errors import PolicyConfigError


def nearest_rank_percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0 < q <= 100) by nearest rank: sorted(values)[⌈q/100·n⌉ − 1].

    Always one of the values (no interpolation), so p95 of 20 samples is the 19th smallest.
    Raises PolicyConfigError on an empty list or q out of range.
    """
    if not values:
        raise PolicyConfigError("percentile of an empty window")
    if not 0.0 < q <= 100.0:
        raise PolicyConfigError("percentile q must be in (0, 100]")
    ordered = sorted(values)
    rank = math.ceil(q / 100.0 * len(ordered))
    return ordered[max(rank, 1) - 1]


class SlidingWindow:
    """Samples (t, value) of the last ``window_s`` seconds. Mutable; not thread-safe.

    A sample at time t is kept while now_s − t <= window_s. Timestamps must not decrease
    (out-of-order samples are accepted but may be dropped early).
    """

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise PolicyConfigError("window_s must be > 0")
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, now_s: float, value: float) -> None:
        self._samples.append((now_s, value))
        self.prune(now_s)

    def prune(self, now_s: float) -> None:
        oldest_ok = now_s - self.window_s
        samples = self._samples
        while samples and samples[0][0] < oldest_ok:
            samples.popleft()

    def values(self, now_s: float) -> list[float]:
        self.prune(now_s)
        return [v for _, v in self._samples]

    def percentile(self, now_s: float, q: float) -> float | None:
        """Nearest-rank percentile of the samples in the window; None when it is empty."""
        vals = self.values(now_s)
        return nearest_rank_percentile(vals, q) if vals else None

    def p95(self, now_s: float) -> float | None:
        return self.percentile(now_s, 95.0)

    def __len__(self) -> int:
        return len(self._samples)


class KeyedWindows:
    """One SlidingWindow per key (e.g. prefill worker id), created on first use."""

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise PolicyConfigError("window_s must be > 0")
        self.window_s = window_s
        self._windows: dict[str, SlidingWindow] = {}

    def add(self, key: str, now_s: float, value: float) -> None:
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = SlidingWindow(self.window_s)
        window.add(now_s, value)

    def p95(self, key: str, now_s: float) -> float | None:
        window = self._windows.get(key)
        return window.p95(now_s) if window is not None else None

    def forget(self, key: str) -> None:
        """Drop a key (worker left the role or the cluster)."""
        self._windows.pop(key, None)

    def keys(self) -> list[str]:
        return list(self._windows)
