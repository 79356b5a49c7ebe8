"""The simulator's decode side of the data path: a KV transfer's arrival, the continuous
batch's iterations (decode tokens plus stolen suffix chunks) and a request's end. A mixin
of ``Simulation`` (cluster.py); the prefill side is prefill_path.py.

What is modelled, mirroring the real services (file names are the ones mirrored):

* worker/decode_role.py — admission reserves blocks for pressure.admission_kv_tokens (the
  prompt plus ``decode_reserve_tokens`` of output, within the context; the worker's
  formula) and counts toward ``max_num_seqs``; it re-checks a planned steal against
  pressure.suffix_allowance_tokens now (its budget, capped by what fits in the TPOT slack on
  the request's real prefix) and refuses the steal (not the request) when it exceeds it.
  Installed requests join the continuous batch at the next iteration; one iteration takes
  T_iter(N, C) (eq. 13) plus, for up to pressure.suffix_chunk_tokens stolen suffix tokens
  (TPOT-safe on the first chunk's prefix; 0 without slack while requests decode),
  T_sfx(chunk, context) each (the emulated engine's cost of a mixed step); a split request's
  first token comes out of the iteration that runs its last suffix chunk. Approximation:
  a request's growth past its reservation is not charged to the block pool (the worker
  allocates it on demand; with ~400k KV tokens and <= 64 sequences the pool is not the
  binding limit), while C_active counts every token. The admission itself is modelled in prefill_path.py (``_admit``: the
  prefill worker asks for it).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from services.sim.events import E_ITER_DONE
from services.sim.workers import SimRequest, SimWorker
from shared.policy.pressure import suffix_chunk_tokens, tpot_slack_s
from shared.policy.roles import DRAIN

if TYPE_CHECKING:
    from services.sim.config import SimConfig
    from shared.policy.config import PolicyConfig
    from shared.policy.predictors import LatencyProfile
    from shared.policy.pressure import DecodeLoad


class DecodePath:
    """Mixin of ``Simulation`` (shares its attributes, declared here for the type checker).
    Mutates the decode workers, the requests and the event queue."""

    if TYPE_CHECKING:
        cfg: SimConfig
        profile: LatencyProfile
        policy: PolicyConfig
        workers: list[SimWorker]
        now: float
        remaining: int
        stolen_tokens: int
        stolen_since_sample: int

        def push(self, t: float, kind: int, a: object, b: object = None) -> None: ...
        def check_drain(self, w: SimWorker) -> None: ...
        def migrate_all(self, d: SimWorker) -> None: ...
        def decode_load(self, d: SimWorker) -> DecodeLoad: ...
        def _free_local(self, w: SimWorker, r: SimRequest) -> None: ...

    # ----------------------------------------------------------------- decode
    def _kv_arrive(self, d: SimWorker, r: SimRequest) -> None:
        self._free_local(self.workers[r.pw], r)  # the transfer ended: UCX no longer reads
        d.reserved_blocks -= r.blocks
        d.held_blocks += r.blocks
        d.receiving -= 1
        d.dec_entered += 1  # the decode flow (workers.py)
        if r.suffix == 0 and self.cfg.first_token_via_decode:
            r.t_first = self.now
        if r.suffix:
            r.sfx_done = 0
            d.suffixes.append(r)
            d.suffix_tokens += r.prompt
        elif r.output == 1:
            r.t_last = r.t_first
            self.finish(d, r)
            return
        else:
            r.ntok, r.outs = r.prompt + 1, 1
            d.pending.append(r)
            d.pending_tokens += r.ntok
        if not d.busy:
            self.start_iter(d)

    def finish(self, d: SimWorker, r: SimRequest) -> None:
        if r.t_last < 0:
            r.t_last = self.now
        r.done = True
        d.release(r)
        self.remaining -= 1
        if d.state == DRAIN and d.requests == 0:
            self.check_drain(d)

    def start_iter(self, d: SimWorker) -> None:
        """Plan and start one decode iteration on idle ``d`` (DecodeRole._plan + step)."""
        if d.pending:
            d.join_pending()
        n = d.n_dec
        c = d.s_ctx + n * d.k
        t = 0.0
        if d.suffixes:
            first = d.suffixes[0]
            slack = tpot_slack_s(self.decode_load(d), self.profile, self.policy)
            budget = suffix_chunk_tokens(
                slack,
                first.prefix + first.sfx_done,
                self.profile,
                self.policy,
                decoding=n > 0,
                idle_chunk_tokens=self.cfg.prefill_chunk_tokens,
            )
            chunks = d.iter_chunks
            profile = self.profile
            for r in d.suffixes:
                if budget <= 0:
                    break
                left = r.suffix - r.sfx_done
                chunk = left if left < budget else budget
                budget -= chunk
                ctx = r.prefix + r.sfx_done
                if chunk == 1:  # the emulated engine prices a 1-token step as decode
                    n += 1
                    c += ctx + 1
                else:
                    t += profile.suffix_time_s(chunk, ctx)
                chunks.append((r, chunk))
        if n:
            t += self.profile.decode_iter_time_s(n, c)
        if n == 0 and not d.iter_chunks:
            d.busy = False
            return
        d.busy = True
        self.push(self.now + t, E_ITER_DONE, d)

    def _iter_done(self, d: SimWorker) -> None:
        now = self.now
        d.k += 1
        last = d.k - 1
        heap = d.finish_heap
        while heap and heap[0][0] <= last:
            _, _, epoch, r = heapq.heappop(heap)
            if r.epoch != epoch or r.dw != d.index or r.done:
                continue  # left this batch (migrated)
            d.leave_batch(r)
            r.t_last = now
            self.finish(d, r)
        if d.iter_chunks:
            for r, chunk in d.iter_chunks:
                r.sfx_done += chunk
                d.suffix_backlog -= chunk
                if r.sfx_done < r.suffix:
                    continue
                d.suffixes.remove(r)
                d.suffix_tokens -= r.prompt
                r.t_first = now  # sampled at the end of the last suffix chunk
                self.stolen_tokens += r.suffix
                self.stolen_since_sample += r.suffix
                if r.output == 1:
                    self.finish(d, r)
                else:
                    r.ntok, r.outs = r.prompt + 1, 1
                    d.pending.append(r)
                    d.pending_tokens += r.ntok
            d.iter_chunks.clear()
        d.busy = False
        if d.state == DRAIN and self.cfg.migrate_on_drain:
            self.migrate_all(d)
        if d.n_dec or d.pending or d.suffixes:
            self.start_iter(d)
        elif d.state == DRAIN:
            self.check_drain(d)
