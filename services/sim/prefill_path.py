"""The simulator's prefill side of the data path: arrivals (pairing, shedding at the door),
the prefill worker's FIFO queue, decode admission (asked by the prefill worker, with the
request waiting, its prompt KV held, while refused) and the prefix's KV transfer. A mixin
of ``Simulation`` (cluster.py); the decode side is decode_path.py.

What is modelled, mirroring the real services (file names are the ones mirrored):

* router/pairing.py — each arrival gets a (prefill, decode) pair among Active workers; with
  shedding on (cfg.shedding, shared/policy/admission.py) a request whose predicted TTFT on
  its prefill worker (queued T_pre + the running prefill's T_pre + its own) exceeds the
  multiple of S_TTFT is rejected at the door (``rejected``, not attained), and so is every
  request while each Active decode worker has ``decode_backlog_batches`` × ``max_num_seqs``
  requests waiting for its admission (the live router's decode-backlog shedding). As the
  live router, both rules are checked once the prefill worker is picked, and a shed
  request's pick is withdrawn (``SimRouter.withdraw``).
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

Deviation (documented, deliberate): admission answers at once (no NATS round trip), and a
re-pair for capacity reads the decode workers' state now (the live worker reads telemetry
at most a tick old) with the waiting counts of the last tick.
"""

from __future__ import annotations

from itertools import islice
from typing import TYPE_CHECKING, cast

from services.sim.events import E_ARRIVAL, E_KV_ARRIVE, E_PREFILL_DONE, E_PREFILL_RETRY
from services.sim.workers import SimRequest, SimWorker
from shared.policy.admission import (
    is_expired,
    least_decode_backlog_batches,
    predicted_ttft_s,
    sheds_for_decode_backlog,
    should_shed,
)
from shared.policy.fluidtoken import select_steal_ratios
from shared.policy.prefill_pressure import QueuedRequest
from shared.policy.roles import DECODE, DRAIN, PREFILL

if TYPE_CHECKING:
    from services.sim.config import SimConfig
    from services.sim.router import SimRouter
    from shared.policy.admission import SheddingConfig
    from shared.policy.config import PolicyConfig
    from shared.policy.fluidtoken import StealBudget
    from shared.policy.predictors import LatencyProfile


class PrefillPath:
    """Mixin of ``Simulation`` (shares its attributes, declared here for the type checker).
    Mutates the workers, the requests and the event queue."""

    if TYPE_CHECKING:
        cfg: SimConfig
        profile: LatencyProfile
        policy: PolicyConfig
        workers: list[SimWorker]
        reqs: list[SimRequest]
        router: SimRouter
        budgets: dict[str, StealBudget]
        shed: SheddingConfig
        now: float
        remaining: int
        refused_steals: int
        split_requests: int
        _next_arrival: int
        _max_ctx: int
        _kv_s_per_token: float

        def push(self, t: float, kind: int, a: object, b: object = None) -> None: ...
        def check_drain(self, w: SimWorker) -> None: ...
        def steal_allowance(self, d: SimWorker, context_tokens: int) -> int: ...
        def waiting_by_decode(self) -> list[tuple[int, int]]: ...

    # ---------------------------------------------------------------- arrivals
    def _arrival(self) -> None:
        r = self.reqs[self._next_arrival]
        self._next_arrival += 1
        if self._next_arrival < len(self.reqs):
            self.push(self.reqs[self._next_arrival].arrival_s, E_ARRIVAL, None)
        if r.prompt + 1 > self._max_ctx:  # engine.check_prompt: rejected at once
            self.fail(r)
            return
        # The live router's door (services/router/admission.py): both rules once the
        # prefill worker is picked; a shed request's pick is withdrawn (round robin: the
        # turn stays taken).
        p = self.router.pick(PREFILL, req=r)
        if sheds_for_decode_backlog(self._decode_backlog(), self.shed) or (
            self.shed.sheds and self._hopeless(p, r)
        ):
            self.router.withdraw(p, r)
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
        waiting = self.waiting_by_decode()
        seqs = self.cfg.max_num_seqs
        return least_decode_backlog_batches(
            (waiting[w.index][0], seqs) for w in self.workers if w.is_active(DECODE)
        )

    def _hopeless(self, p: SimWorker, r: SimRequest) -> bool:
        """The router's door check: predicted TTFT on ``p`` over the shedding threshold."""
        ahead_s = p.queued_work_s(self.profile)
        return should_shed(
            predicted_ttft_s(ahead_s, r.prompt, self.profile), self.policy.ttft_s, self.shed
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
        w.busy_clock.start(now)
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
        blocks = r.reserve_blocks
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
        need = r.reserve_blocks
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
        w.busy_clock.stop(now)
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
