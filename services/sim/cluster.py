"""Discrete-event simulation of a FluidPD cluster: the data path (router → prefill → KV
transfer → decode). Telemetry, FluidRole and switching are in control.py.

What is modelled, mirroring the real services (file names are the ones mirrored):

* router/pairing.py — each arrival gets a (prefill, decode) pair among Active workers; with
  shedding on (cfg.shedding, shared/policy/admission.py) a request whose predicted TTFT on
  its prefill worker (queued T_pre + the running prefill's T_pre + its own) exceeds the
  multiple of S_TTFT is rejected at the door (``rejected``, not attained), and so is every
  request while each Active decode worker has ``decode_backlog_batches`` × ``max_num_seqs``
  requests waiting for its admission (the live router's decode-backlog shedding).
* worker/prefill/prefill_role.py — FIFO queue, one request per prefill iteration; a request
  whose TTFT deadline passed by more than the expiry margin is dropped when it reaches the
  head (``expired``); the head waits while earlier prompts hold the blocks it needs. At the
  head: Algorithm 1 (``select_steal_ratios``, FluidToken configs) over the queue with the
  freshest steal budgets, suffix = min(plan, L − 1). A proposed split asks the paired decode
  worker first; otherwise (or when it refuses for capacity) the whole prompt computes for
  T_pre(L) (eq. 2) while admission is asked beside it. A refused request **waits** with its
  prompt KV held here (part of the worker's block pool) while the next prefill starts
  (prefill/admission.py): retried every 20 ms (batch full) / 50 ms (no blocks), re-paired
  with an Active decode worker that has room (``decode_with_capacity``) or when its worker
  left the decode role, failed after ``decode_wait_s`` of waiting. The first token is
  streamed once the prefill ends when nothing was stolen; the prefix KV leaves over the
  worker's link (serialised) at ``kv_bytes_per_token × L_pfx / bandwidth`` once both the
  prefill and the admission are done; its blocks are freed when it arrives.
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
  binding limit), while C_active counts every token.

Deviation (documented, deliberate): admission answers at once (no NATS round trip), and a
re-pair for capacity reads the decode workers' state now (the live worker reads telemetry
at most a tick old) with the waiting counts of the last tick.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from itertools import islice
from typing import cast

from services.sim.config import SimConfig
from services.sim.control import ControlPlane
from services.sim.events import (
    E_ARRIVAL,
    E_CONTROL,
    E_DRAIN_CHECK,
    E_DRAIN_TIMEOUT,
    E_ITER_DONE,
    E_KV_ARRIVE,
    E_MIGRATE_ARRIVE,
    E_PREFILL_DONE,
    E_PREFILL_RETRY,
    E_SAMPLE,
    E_SWITCH_DONE,
    E_TELEMETRY,
)
from services.sim.results import SimResult
from services.sim.router import SimRouter
from services.sim.workers import SimRequest, SimWorker, initial_workers
from shared.policy.admission import (
    is_expired,
    predicted_ttft_s,
    queue_work_s,
    sheds_for_decode_backlog,
    should_shed,
)
from shared.policy.fluidtoken import StealBudget, select_steal_ratios
from shared.policy.predictors import LatencyProfile
from shared.policy.prefill_pressure import QueuedRequest
from shared.policy.pressure import (
    admission_kv_tokens,
    suffix_chunk_tokens,
    tpot_slack_s,
)
from shared.policy.roles import DECODE, DRAIN, PREFILL
from shared.trace_request import TraceRequest


class SimulationError(RuntimeError):
    """The simulation lost a request (a bug): the event queue ran dry with requests open."""


class Simulation(ControlPlane):
    """One run. ``run()`` may be called once; everything is simulated seconds from 0."""

    def __init__(
        self,
        trace: Sequence[TraceRequest],
        cfg: SimConfig,
        profile: LatencyProfile,
        label: str = "",
    ) -> None:
        self.cfg = cfg
        self.profile = profile
        self.policy = cfg.policy
        self.label = label
        num_blocks = cfg.num_kv_blocks or max(1, profile.kv_capacity_tokens // cfg.block_size)
        self.workers: list[SimWorker] = initial_workers(
            cfg.workers, cfg.initial_prefill, num_blocks
        )
        self.router = SimRouter(
            self.workers,
            cfg.pairing,
            profile,
            cfg.policy.ttft_s,
            cfg.block_size,
            cfg.max_num_seqs,
            cfg.decode_reserve_tokens,
        )
        ordered = sorted(trace, key=lambda t: t.arrival_s)
        self.reqs = [
            SimRequest(i, t.arrival_s, t.prompt_tokens, t.output_tokens, t.source, t.window)
            for i, t in enumerate(ordered)
        ]
        self.budgets: dict[str, StealBudget] = {}
        self.now = 0.0
        self.remaining = len(self.reqs)
        self.events = 0
        self.stolen_tokens = 0
        self.split_requests = 0
        self.refused_steals = 0
        self.shed = cfg.shedding
        self._heap: list[tuple[float, int, int, object, object]] = []
        self._seq = 0
        self._next_arrival = 0
        self._max_ctx = profile.max_context_tokens
        self._kv_s_per_token = profile.kv_bytes_per_token / cfg.kv_bandwidth_bytes_per_s
        self.init_control()

    # ------------------------------------------------------------------ engine
    def push(self, t: float, kind: int, a: object, b: object = None) -> None:
        heapq.heappush(self._heap, (t, self._seq, kind, a, b))
        self._seq += 1

    def run(self) -> SimResult:
        """Replay every request to completion (or failure). Raises SimulationError."""
        started = time.perf_counter()
        if self.reqs:
            self.push(self.reqs[0].arrival_s, E_ARRIVAL, None)
            self.start_ticks()
        heap, pop = self._heap, heapq.heappop
        while heap:
            t, _, kind, a, b = pop(heap)
            self.now = t
            self.events += 1
            if kind == E_ITER_DONE:
                self._iter_done(a)  # type: ignore[arg-type]
            elif kind == E_KV_ARRIVE:
                self._kv_arrive(a, b)  # type: ignore[arg-type]
            elif kind == E_PREFILL_DONE:
                self._prefill_done(a, b)  # type: ignore[arg-type]
            elif kind == E_ARRIVAL:
                self._arrival()
            elif kind == E_TELEMETRY:
                self.on_telemetry()
            elif kind == E_PREFILL_RETRY:
                self._prefill_retry(a, b)  # type: ignore[arg-type]
            elif kind == E_SAMPLE:
                self.on_sample()
            elif kind == E_CONTROL:
                self.on_control()
            elif kind == E_MIGRATE_ARRIVE:
                self.on_migrate_arrive(a, b)  # type: ignore[arg-type]
            elif kind == E_DRAIN_CHECK:
                self.check_drain(a)  # type: ignore[arg-type]
            elif kind == E_SWITCH_DONE:
                self.on_switch_done(a, b)  # type: ignore[arg-type]
            elif kind == E_DRAIN_TIMEOUT:
                self.on_drain_timeout(a, b)  # type: ignore[arg-type]
        if self.remaining != 0:  # < 0: some request completed twice
            raise SimulationError(f"{self.remaining} requests left open (negative: twice done)")
        return SimResult.from_requests(
            self.label,
            self.reqs,
            switches=self.switches,
            stolen_tokens=self.stolen_tokens,
            split_requests=self.split_requests,
            refused_steals=self.refused_steals,
            migrations=self.migrations,
            series=self.series,
            sim_time_s=self.now,
            wall_s=time.perf_counter() - started,
            events=self.events,
        )

    # ---------------------------------------------------------------- arrivals
    def _arrival(self) -> None:
        r = self.reqs[self._next_arrival]
        self._next_arrival += 1
        if self._next_arrival < len(self.reqs):
            self.push(self.reqs[self._next_arrival].arrival_s, E_ARRIVAL, None)
        if r.prompt + 1 > self._max_ctx:  # engine.check_prompt: rejected at once
            self.fail(r)
            return
        if sheds_for_decode_backlog(self._decode_backlog(), self.shed):
            r.rejected = True
            self.fail(r)
            return
        p = self.router.pick(PREFILL, req=r)
        if self.shed.sheds and self._hopeless(p, r):
            r.rejected = True
            self.fail(r)
            return
        d = self.router.pick(DECODE, req=r)
        r.pw, r.dw, r.decode_id = p.index, d.index, d.wid
        p.queue.append(r)
        if p.current is None:
            self.prefill_next(p)

    def _decode_backlog(self) -> float | None:
        """The live router's decode backlog now (``AdmissionGate.decode_backlog``): the
        smallest count of requests waiting for admission (refused, retried) over
        the Active decode workers, in batches of ``max_num_seqs``. None when shedding on it
        is off (saves the count)."""
        if self.shed.decode_backlog_batches <= 0:
            return None
        waiting = [0] * len(self.workers)
        for w in self.workers:
            for r in w.adm_waiting.values():
                waiting[r.dw] += 1
        seqs = max(1, self.cfg.max_num_seqs)
        return min(
            (waiting[w.index] / seqs for w in self.workers if w.is_active(DECODE)), default=None
        )

    def _hopeless(self, p: SimWorker, r: SimRequest) -> bool:
        """The router's door check: predicted TTFT on ``p`` over the shedding threshold."""
        profile = self.profile
        running_s = profile.prefill_time_s(p.current.prompt) if p.current is not None else 0.0
        ahead_s = queue_work_s((x.prompt for x in p.queue), profile, running_remaining_s=running_s)
        return should_shed(
            predicted_ttft_s(ahead_s, r.prompt, profile), self.policy.ttft_s, self.shed
        )

    def fail(self, r: SimRequest) -> None:
        r.failed = True
        r.done = True
        self.remaining -= 1

    # ---------------------------------------------------------------- prefill
    def prefill_next(self, w: SimWorker) -> None:
        """Start the head of ``w``'s queue if ``w`` is idle (the prefill loop's wakeup). The
        head waits while earlier prompts hold the blocks it needs (PrefillRole.run)."""
        timeout = self.cfg.queue_timeout_s
        bs = self.cfg.block_size
        while w.current is None and w.queue:
            r = w.queue[0]
            if timeout and self.now - r.arrival_s > timeout:
                w.queue.popleft()
                self.fail(r)  # aborted before its prefill started (no work done)
                continue
            if is_expired(r.arrival_s + self.policy.ttft_s, self.now, self.shed):
                w.queue.popleft()
                r.expired = True
                self.fail(r)
                continue
            if w.free_blocks < -(-r.prompt // bs) and w.local_blocks:
                return  # woken when a held prompt's blocks are freed (_free_local)
            w.queue.popleft()
            w.current = r
            self._start_prefill(w, r)
        if w.current is None and w.state == DRAIN:
            self.check_drain(w)

    def _start_prefill(self, w: SimWorker, r: SimRequest) -> None:
        """PrefillRole._serve: a proposed split asks admission first (its answer decides
        what is computed; a capacity refusal runs the prompt unsplit); otherwise the prefill
        starts at once and admission is asked beside it (a refusal: the request waits)."""
        cfg, now = self.cfg, self.now
        self._ensure_decode_pair(r)
        sfx = 0
        if cfg.fluidtoken and self.budgets:
            view = [r, *islice(w.queue, cfg.policy_queue_window - 1)]
            plan = select_steal_ratios(
                cast("list[QueuedRequest]", view), self.budgets, self.profile, self.policy, now
            )
            sfx = min(plan.stolen_tokens.get(0, 0), r.prompt - 1)
        admitted = sfx > 0 and self._admit(self.workers[r.dw], r, sfx) == 0.0
        prefix = r.prefix if admitted else r.prompt
        r.local_blocks = -(-prefix // cfg.block_size)
        w.local_blocks += r.local_blocks
        self.push(now + self.profile.prefill_time_s(prefix), E_PREFILL_DONE, w, r)
        if not admitted:
            self._ask_admission(w, r)

    def _ensure_decode_pair(self, r: SimRequest) -> None:
        """Re-pair ``r`` when its decode worker left the Active decode role (a draining
        worker answers retry_after_ms 0: admission.py re-pairs). Mutates ``r.dw``."""
        if not self.workers[r.dw].is_active(DECODE):
            d = self.router.pick(DECODE, req=r)
            r.dw, r.decode_id = d.index, d.wid

    def _admit(self, d: SimWorker, r: SimRequest, sfx: int) -> float:
        """DecodeRole.admit at ``d``: 0.0 once it reserved for ``r`` (sets r.blocks,
        r.suffix, r.prefix; a steal over its allowance is refused, not the request), else
        the retry period of its refusal."""
        cfg = self.cfg
        if not d.admitting:
            return cfg.retry_not_admitting_s
        if d.requests >= cfg.max_num_seqs:
            return cfg.retry_batch_full_s
        if sfx > 0 and sfx > self.steal_allowance(d, r.prompt - sfx):
            sfx = 0
            self.refused_steals += 1
        kv = admission_kv_tokens(r.prompt, r.output, cfg.decode_reserve_tokens, self._max_ctx)
        blocks = -(-kv // cfg.block_size)
        if d.free_blocks < blocks:
            return cfg.retry_no_blocks_s
        d.reserved_blocks += blocks
        d.requests += 1
        d.receiving += 1
        r.blocks, r.suffix, r.prefix = blocks, sfx, r.prompt - sfx
        d.suffix_backlog += sfx
        return 0.0

    def _ask_admission(self, w: SimWorker, r: SimRequest) -> None:
        """One round of admission.py's loop for unsplit ``r``: admitted (exported now if
        computed), or waiting (counted in ``w.adm_waiting`` from the first refusal),
        re-paired to a decode worker with room (``_with_capacity``), given up after
        ``decode_wait_s`` of waiting (failed, its KV freed), or retried later."""
        now = self.now
        for _ in range(2):  # the first answer, and one more after a re-pair for capacity
            self._ensure_decode_pair(r)
            d = self.workers[r.dw]
            retry_s = self._admit(d, r, 0)
            if retry_s == 0.0:
                if w.adm_waiting.pop(r.idx, None) is not None:
                    r.wait_since = -1.0
                if r.computed:
                    self._export(w, r)
                return
            if r.wait_since < 0:
                r.wait_since = now
                w.adm_waiting[r.idx] = r
            if now - r.wait_since > self.cfg.decode_wait_s:
                del w.adm_waiting[r.idx]
                self.fail(r)  # decode_wait_timeout (in-band after its first token)
                if r.computed:
                    self._free_local(w, r)
                return
            other = self._with_capacity(d, r)
            if other is None:
                break
            r.dw, r.decode_id = other.index, other.wid
        self.push(now + retry_s, E_PREFILL_RETRY, w, r)

    def _with_capacity(self, d: SimWorker, r: SimRequest) -> SimWorker | None:
        """decode_choice.pick_with_capacity: an Active decode worker other than ``d`` with
        a slot and the blocks ``r`` reserves beyond those its waiting requests would take;
        the one with the most free blocks. Reads the state now (the live worker reads
        telemetry at most a tick old) and the waiting counts of the last tick."""
        cfg = self.cfg
        bs = cfg.block_size
        kv = admission_kv_tokens(r.prompt, r.output, cfg.decode_reserve_tokens, self._max_ctx)
        need = -(-kv // bs)
        best: SimWorker | None = None
        for x in self.workers:
            if x is d or not x.is_active(DECODE):
                continue
            if cfg.max_num_seqs - x.requests - x.waiting_tel <= 0:
                continue
            if x.free_blocks - -(-x.waiting_kv_tel // bs) < need:
                continue
            if best is None or x.free_blocks > best.free_blocks:
                best = x
        return best

    def _prefill_retry(self, w: SimWorker, r: SimRequest) -> None:
        if not r.done and r.blocks == 0:
            self._ask_admission(w, r)

    def _prefill_done(self, w: SimWorker, r: SimRequest) -> None:
        now = self.now
        w.current = None
        r.computed = True
        if r.done:  # gave up waiting for decode while computing: free the prompt's KV
            self._free_local(w, r)
        else:
            if r.suffix == 0:
                r.t_first = now  # first token sampled and streamed by the prefill worker
            else:
                self.split_requests += 1
            if r.blocks:
                self._export(w, r)
            # else: it waits for decode admission holding its KV; the next prefill starts
        self.prefill_next(w)

    def _export(self, w: SimWorker, r: SimRequest) -> None:
        """The prefix KV leaves over ``w``'s serialised link into the reserved blocks."""
        start = self.now if self.now > w.link_free_s else w.link_free_s
        arrive = start + self.cfg.kv_transfer_overhead_s + r.prefix * self._kv_s_per_token
        w.link_free_s = arrive
        self.push(arrive, E_KV_ARRIVE, self.workers[r.dw], r)

    def _free_local(self, w: SimWorker, r: SimRequest) -> None:
        """Free the prompt KV ``r`` holds on prefill worker ``w``; a head waiting for
        blocks may start."""
        w.local_blocks -= r.local_blocks
        r.local_blocks = 0
        if w.current is None and w.queue:
            self.prefill_next(w)

    # ----------------------------------------------------------------- decode
    def _kv_arrive(self, d: SimWorker, r: SimRequest) -> None:
        self._free_local(self.workers[r.pw], r)  # the transfer ended: UCX no longer reads
        d.reserved_blocks -= r.blocks
        d.held_blocks += r.blocks
        d.receiving -= 1
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
