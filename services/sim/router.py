"""The router's pairing, as services/router/pairing.py does it, over simulated workers.

* round_robin: independent cursors over the sorted Active prefill ids and decode ids.
* pressure: the Active prefill worker with the lowest PPI (ties: shortest queue counting the
  requests sent since its last telemetry), the Active decode worker with the lowest
  ``round(dpi_adm, 3)`` (ties: fewest sent since telemetry, then most free blocks), then id.
  Telemetry in the simulator is never stale (every worker publishes every 20 ms), so the
  real policy's stale-telemetry fallback never applies.
"""

from __future__ import annotations

from services.sim.workers import SimWorker
from shared.policy.fluidrole import DECODE, PREFILL


class NoActiveWorker(RuntimeError):
    """No Active worker of a role (cannot happen: FluidRole never empties a role)."""


class SimRouter:
    """Mutates its cursors and the workers' ``sent_since`` counters."""

    def __init__(self, workers: list[SimWorker], pairing: str) -> None:
        self.workers = workers
        self.pressure = pairing == "pressure"
        self._cursor = {PREFILL: 0, DECODE: 0}

    def _active(self, role: str, exclude: int = -1) -> list[SimWorker]:
        # Workers are indexed in id order, so this list is already sorted by id.
        out = [w for w in self.workers if w.role == role and w.state == "active"]
        if exclude >= 0 and len(out) > 1:
            out = [w for w in out if w.index != exclude]
        if not out:
            raise NoActiveWorker(f"no active {role} worker")
        return out

    def pick(self, role: str, exclude: int = -1) -> SimWorker:
        """One worker of ``role`` for a new request (``exclude``: a worker to avoid)."""
        ids = self._active(role, exclude)
        if not self.pressure:
            i = self._cursor[role]
            self._cursor[role] = i + 1
            return ids[i % len(ids)]
        if role == PREFILL:
            best = min(ids, key=lambda w: (w.ppi, w.queue_len_tel + w.sent_since, w.wid))
        else:
            best = min(
                ids, key=lambda w: (round(w.dpi_adm, 3), w.sent_since, -w.free_blocks_tel, w.wid)
            )
        best.sent_since += 1
        return best
