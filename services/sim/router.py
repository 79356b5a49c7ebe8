"""The router's pairing, as services/router/pairing.py does it, over simulated workers.

* round_robin: independent cursors over the sorted Active prefill ids and decode ids.
* pressure: the same ranking as the real ``PressurePolicy``, through the same scoring
  functions (``prefill_wait_s``, ``prefill_score``, ``decode_score``): the Active prefill
  worker with the least predicted wait — its queued work at its last telemetry
  (``queue_work_tel``, the door's ``queue_work_s``) + Σ T_pre(L) over the requests sent
  since — then the lowest estimated PPI (telemetry PPI + that Σ / S_TTFT; ties: telemetry
  queue length + sent since) — and the Active decode worker with
  the lowest estimated admission pressure — the larger of telemetry DPI_adm + the blocks of
  its unsettled pairings / its blocks, and (running + unsettled) / ``max_num_seqs`` (ties:
  unsettled, then most free blocks) — then id. A decode pairing is settled when the
  request's first token is out (or it ended, or was re-paired): the real router settles at
  the first token it receives (it passes request ids to ``choose``).

Telemetry in the simulator is instantaneous and never stale (every worker publishes every
20 ms and sees a request the moment it is sent), so a telemetry tick supersedes the whole
prefill estimate (the real router keeps the sends of the last few ms, see its module doc)
and the stale-telemetry fallback never applies. A request the door sheds after its pick is
withdrawn (``withdraw``, the real policy's ``withdraw``): under pressure pairing its T_pre
stops counting; a round-robin turn stays taken. A tick shows here as the worker's
``sent_since`` counter reset to 0 (telemetry.py). Settled pairings are pruned off the front of
each decode worker's list (pairing order), so one settled behind an unsettled one counts a
little longer than in the real router (an approximation that keeps a pick O(workers)). The
decode reservation counted is exactly what admission will reserve (the request's
``reserve_blocks``: admission_kv_tokens, the worker's formula, with the simulated request's
output as its max_tokens).
"""

from __future__ import annotations

from collections import deque

from services.sim.workers import SimRequest, SimWorker
from shared.policy.pairing import decode_score, prefill_score, prefill_wait_s
from shared.policy.predictors import LatencyProfile
from shared.policy.roles import ACTIVE, DECODE, PREFILL, Role


class NoActiveWorker(RuntimeError):
    """No Active worker of a role (cannot happen: FluidRole never empties a role)."""


class SimRouter:
    """Mutates its cursors, its per-worker send estimates and the workers' ``sent_since``."""

    def __init__(
        self,
        workers: list[SimWorker],
        pairing: str,
        profile: LatencyProfile | None = None,
        ttft_s: float = 2.0,
        max_num_seqs: int = 0,
    ) -> None:
        self.workers = workers
        self.pressure = pairing == "pressure"
        self.profile = profile
        self.ttft_s = ttft_s
        self.max_num_seqs = max_num_seqs
        self._cursor = {PREFILL: 0, DECODE: 0}
        # Since each worker's last telemetry (valid while its sent_since > 0).
        self._sent_work_s = [0.0] * len(workers)
        # Decode pairings not settled yet (no first token), in pairing order, and sums.
        self._pending: list[deque[tuple[SimRequest, int]]] = [deque() for _ in workers]
        self._pend_blocks = [0] * len(workers)

    def _active(self, role: Role, exclude: int = -1) -> list[SimWorker]:
        # Workers are indexed in id order, so this list is already sorted by id.
        out = [w for w in self.workers if w.role == role and w.state == ACTIVE]
        if exclude >= 0 and len(out) > 1:
            out = [w for w in out if w.index != exclude]
        if not out:
            raise NoActiveWorker(f"no active {role} worker")
        return out

    def pick(self, role: Role, exclude: int = -1, req: SimRequest | None = None) -> SimWorker:
        """One worker of ``role`` for ``req`` (``exclude``: a worker to avoid). Without
        ``req`` (or a profile) a send counts only in ``sent_since``."""
        ids = self._active(role, exclude)
        if not self.pressure:
            i = self._cursor[role]
            self._cursor[role] = i + 1
            return ids[i % len(ids)]
        if role == PREFILL:
            return self._pick_prefill(ids, req)
        return self._pick_decode(ids, req)

    def _pick_prefill(self, ids: list[SimWorker], req: SimRequest | None) -> SimWorker:
        work, ttft = self._sent_work_s, self.ttft_s
        best = min(
            ids,
            key=lambda w: (
                prefill_wait_s(w.queue_work_tel, work[w.index] if w.sent_since else 0.0),
                prefill_score(w.ppi, work[w.index] if w.sent_since else 0.0, ttft),
                w.queue_len_tel + w.sent_since,
                w.wid,
            ),
        )
        i = best.index
        if best.sent_since == 0:  # a telemetry tick since the last send: start afresh
            work[i] = 0.0
        best.sent_since += 1
        if req is not None and self.profile is not None:
            work[i] += max(0.0, self.profile.prefill_time_s(req.prompt))
        return best

    def withdraw(self, w: SimWorker, req: SimRequest) -> None:
        """Undo ``pick(PREFILL, req=req)`` on ``w`` for a request the door then shed (the
        live router's ``withdraw``): its T_pre no longer counts against ``w``."""
        if not self.pressure or w.sent_since <= 0:
            return
        w.sent_since -= 1
        if self.profile is not None:
            work = self._sent_work_s
            work[w.index] = max(0.0, work[w.index] - self.profile.prefill_time_s(req.prompt))

    def _unsettled(self, w: SimWorker) -> int:
        """Prune settled pairings off the front of ``w``'s list; return how many remain."""
        q = self._pending[w.index]
        while q:
            r, blocks = q[0]
            if r.t_first < 0 and not r.done and r.dw == w.index:
                break
            q.popleft()
            self._pend_blocks[w.index] -= blocks
        return len(q)

    def _pick_decode(self, ids: list[SimWorker], req: SimRequest | None) -> SimWorker:
        pend, seqs = self._pend_blocks, self.max_num_seqs

        def key(w: SimWorker) -> tuple[float, int, int, str]:
            n = self._unsettled(w)  # prunes first, so pend[] is current
            blocks = pend[w.index]
            score = decode_score(w.dpi_adm, blocks, w.num_blocks, w.running_tel, n, seqs)
            return (score, n, blocks - w.free_blocks_tel, w.wid)

        best = min(ids, key=key)
        best.sent_since += 1
        if req is not None and self.profile is not None:
            blocks = req.reserve_blocks
            self._pending[best.index].append((req, blocks))
            pend[best.index] += blocks
        return best
