"""CPU sets for a local cluster: which cores the control plane and the workers may use.

Why: the control plane (nats-server, router, controller) does little work but sits on the
latency path of every token. On a small host a worker's burst (a KV export, a decode
step's Python) that takes the core the router needs delays a token by up to one scheduler
slice (~1.5 ms on Linux EEVDF; docs/serve-latency.md). Separate cores remove that
contention, as any production deployment does for its front end. Empty = no pinning.

Syntax: ``taskset -c`` lists, e.g. ``"0"``, ``"0,2-3"``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable


class CpuSetError(ValueError):
    """A CPU list that does not parse, or names CPUs this process may not use."""


def parse_cpus(text: str) -> tuple[int, ...]:
    """``"0,2-3"`` -> ``(0, 2, 3)``; ``""`` -> ``()``. Raises CpuSetError."""
    out: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo_s, sep, hi_s = part.partition("-")
        try:
            lo = int(lo_s)
            hi = int(hi_s) if sep else lo
        except ValueError:
            raise CpuSetError(f"bad CPU list {text!r} (expected e.g. 0,2-3)") from None
        if lo < 0 or hi < lo:
            raise CpuSetError(f"bad CPU range {part!r} in {text!r}")
        out.update(range(lo, hi + 1))
    return tuple(sorted(out))


def available_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on."""
    return tuple(sorted(os.sched_getaffinity(0)))


def check_cpus(cpus: Iterable[int], what: str) -> tuple[int, ...]:
    """``cpus`` as a sorted tuple. Raises CpuSetError if one is not available here."""
    wanted = tuple(sorted(set(cpus)))
    missing = set(wanted) - set(available_cpus())
    if missing:
        raise CpuSetError(
            f"{what}: CPU(s) {sorted(missing)} not available (this process may use "
            f"{list(available_cpus())})"
        )
    return wanted


def split_control_workers() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The default split for a benchmark: the first available CPU for the control plane,
    the rest for the workers; ``((), ())`` (no pinning) on a single CPU."""
    cpus = available_cpus()
    if len(cpus) < 2:
        return (), ()
    return cpus[:1], cpus[1:]


def pin_self(cpus: tuple[int, ...]) -> Callable[[], None] | None:
    """A ``preexec_fn`` that pins the child (and every thread it starts) to ``cpus``, or
    None for ``()``. Runs between fork and exec: no allocation-heavy work."""
    if not cpus:
        return None
    target = frozenset(cpus)

    def apply() -> None:
        os.sched_setaffinity(0, target)

    return apply
