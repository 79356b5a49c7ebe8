"""Choosing a (prefill worker, decode worker) pair for a request.

* ``round_robin`` — the paper's baseline: cycles prefill workers and decode workers
  independently, ignoring load.
* ``pressure`` (default) — uses WorkerTelemetry: the prefill worker with the lowest PPI
  (ties: shortest queue), the decode worker with the lowest admission pressure ``dpi_adm``
  (ties: most free KV blocks). Requests sent to a worker since its last telemetry count as
  extra queue, so a burst between two telemetry messages spreads out. Workers without
  fresh telemetry rank last; with no fresh telemetry at all it falls back to round robin.

Only records in state ``active`` are candidates (callers pass them filtered).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from shared.messages import WorkerRecord, WorkerTelemetry


class NoWorkerError(Exception):
    """No candidate for a role (after exclusions)."""


class PairingPolicy(Protocol):
    name: str

    def choose(
        self,
        prefill: Sequence[WorkerRecord],
        decode: Sequence[WorkerRecord],
        exclude: frozenset[str] = frozenset(),
    ) -> tuple[str, str]:
        """Return (prefill_worker_id, decode_worker_id). Raises NoWorkerError."""
        ...


def _candidates(records: Sequence[WorkerRecord], exclude: frozenset[str], role: str) -> list[str]:
    ids = sorted(r.worker_id for r in records if r.worker_id not in exclude)
    if not ids:
        # Retrying on an excluded worker beats refusing when it is the only one.
        ids = sorted(r.worker_id for r in records)
    if not ids:
        raise NoWorkerError(f"no active {role} worker")
    return ids


class RoundRobinPolicy:
    """Independent cursors over the sorted prefill and decode ids. Mutates its cursors."""

    name = "round_robin"

    def __init__(self) -> None:
        self._cursor = {"prefill": 0, "decode": 0}

    def pick(self, role: str, ids: list[str]) -> str:
        i = self._cursor[role]
        self._cursor[role] = i + 1
        return ids[i % len(ids)]

    def choose(
        self,
        prefill: Sequence[WorkerRecord],
        decode: Sequence[WorkerRecord],
        exclude: frozenset[str] = frozenset(),
    ) -> tuple[str, str]:
        p_ids = _candidates(prefill, exclude, "prefill")
        d_ids = _candidates(decode, exclude, "decode")
        return self.pick("prefill", p_ids), self.pick("decode", d_ids)


class PressurePolicy:
    """Pressure-aware pairing from telemetry (see module doc). Mutates its telemetry view."""

    name = "pressure"

    def __init__(self, stale_after_s: float = 1.0) -> None:
        self.stale_after_s = stale_after_s
        self._latest: dict[str, tuple[WorkerTelemetry, float]] = {}  # id -> (msg, mono time)
        self._sent_since: dict[str, int] = {}  # requests sent since the last telemetry
        self._fallback = RoundRobinPolicy()

    def observe(self, msg: WorkerTelemetry, now_mono_s: float | None = None) -> None:
        """Record a telemetry message (bus callback)."""
        now = time.monotonic() if now_mono_s is None else now_mono_s
        self._latest[msg.publisher_id] = (msg, now)
        self._sent_since[msg.publisher_id] = 0

    def forget(self, worker_id: str) -> None:
        self._latest.pop(worker_id, None)
        self._sent_since.pop(worker_id, None)

    def _fresh(self, worker_id: str, now: float) -> WorkerTelemetry | None:
        entry = self._latest.get(worker_id)
        if entry is None or now - entry[1] > self.stale_after_s:
            return None
        return entry[0]

    def _pick(self, role: str, ids: list[str], now: float) -> str:
        fresh = {w: t for w in ids if (t := self._fresh(w, now)) is not None}
        if not fresh:
            return self._fallback.pick(role, ids)

        def key(worker_id: str) -> tuple[float, ...]:
            tel = fresh.get(worker_id)
            if tel is None:
                return (1.0, 0.0, 0.0, 0.0)
            extra = self._sent_since.get(worker_id, 0)
            if role == "prefill":
                return (0.0, tel.ppi, float(tel.queue_len + extra), 0.0)
            return (0.0, round(tel.dpi_adm, 3), float(extra), -float(tel.free_blocks))

        chosen = min(ids, key=lambda w: (key(w), w))
        self._sent_since[chosen] = self._sent_since.get(chosen, 0) + 1
        return chosen

    def choose(
        self,
        prefill: Sequence[WorkerRecord],
        decode: Sequence[WorkerRecord],
        exclude: frozenset[str] = frozenset(),
    ) -> tuple[str, str]:
        now = time.monotonic()
        p_ids = _candidates(prefill, exclude, "prefill")
        d_ids = _candidates(decode, exclude, "decode")
        return self._pick("prefill", p_ids, now), self._pick("decode", d_ids, now)


def make_policy(name: str, stale_after_s: float = 1.0) -> RoundRobinPolicy | PressurePolicy:
    """Policy by name (``pressure`` or ``round_robin``). Raises ValueError."""
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "pressure":
        return PressurePolicy(stale_after_s)
    raise ValueError(f"unknown pairing policy {name!r}")
