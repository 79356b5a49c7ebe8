"""The simulator's prefill side of the data path: arrivals (pairing, shedding at the door),
the prefill worker's FIFO queue, decode admission and the prefix's KV transfer. A mixin of
``Simulation`` (cluster.py); the decode side is decode_path.py.

What is modelled, mirroring the real services (file names are the ones mirrored):

* router/pairing.py — each arrival gets a (prefill, decode) pair among Active workers; with
  shedding on (cfg.shedding, shared/policy/admission.py) a request whose predicted TTFT on
  its prefill worker (queued T_pre + the running prefill's T_pre + its own) exceeds the
  multiple of S_TTFT is rejected at the door (``rejected``, not attained), and so is every
  request while each Active decode worker has ``decode_backlog_batches`` × ``max_num_seqs``
  requests waiting for its admission (the live router's decode-backlog shedding).
* worker/prefill_role.py — FIFO queue, one request per prefill iteration; a request whose
  TTFT deadline passed by more than the expiry margin is dropped when it reaches the head
  (``expired``). At the head:
  Algorithm 1 (``select_steal_ratios``, FluidToken configs) over the queue with the freshest
  steal budgets, suffix = min(plan, L − 1); then admission at the paired decode worker,
  retried every 20 ms (batch full) / 50 ms (no blocks) while the request holds the head,
  given up after max(admit_timeout, remaining TTFT budget) (the request fails); then the
  prefix computes for T_pre(L_pfx) (eq. 2); the first token is streamed at once when nothing
  was stolen; the prefix KV leaves over the worker's link (serialised) at
  ``kv_bytes_per_token × L_pfx / bandwidth`` while the next prefill starts.

Deviations (documented, deliberate): a queued request whose paired decode worker has left
the Active decode role (D→P drain) is re-paired to another decode worker when it reaches
the head; the real prefill worker keeps retrying the original worker until it gives up.
Decode admission is asked before the prefill, so a request the decode side refuses blocks
its prefill worker's queue head; the real prefill worker computes it, keeps its KV while it
waits and goes on with the next prompt. So here at most one request per prefill worker waits
for decode admission (what DPI_adm and the router's decode-backlog shedding count).
"""

from __future__ import annotations

from itertools import islice
from typing import TYPE_CHECKING, cast

from services.sim.events import E_ARRIVAL, E_KV_ARRIVE, E_PREFILL_DONE, E_PREFILL_RETRY
from services.sim.workers import SimRequest, SimWorker
from shared.policy.admission import (
    is_expired,
    predicted_ttft_s,
    queue_work_s,
    sheds_for_decode_backlog,
    should_shed,
)
from shared.policy.fluidtoken import select_steal_ratios
from shared.policy.prefill_pressure import QueuedRequest
from shared.policy.pressure import admission_kv_tokens
from shared.policy.roles import ACTIVE, DECODE, DRAIN, PREFILL

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
        smallest count of requests waiting for admission (prefill heads retrying it) over
        the Active decode workers, in batches of ``max_num_seqs``. None when shedding on it
        is off (saves the count). With one waiting head per prefill worker at most, it
        reaches 1 batch (64) only on very large clusters: the real prefill worker computes
        on while its computed prompts wait, so it can hold many (module doc: deviation)."""
        if self.shed.decode_backlog_batches <= 0:
            return None
        waiting = [0] * len(self.workers)
        for w in self.workers:
            r = w.current
            if r is not None and not r.blocks and r.dw >= 0:
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
        """Start the head of ``w``'s queue if ``w`` is idle (the prefill loop's wakeup)."""
        timeout = self.cfg.queue_timeout_s
        while w.current is None and w.queue:
            r = w.queue.popleft()
            if timeout and self.now - r.arrival_s > timeout:
                self.fail(r)  # aborted before its prefill started (no work done)
                continue
            if is_expired(r.arrival_s + self.policy.ttft_s, self.now, self.shed):
                r.expired = True
                self.fail(r)
                continue
            w.current = r
            self._try_admit(w, r, True)
        if w.current is None and w.state == DRAIN:
            self.check_drain(w)

    def _prefill_retry(self, w: SimWorker, r: SimRequest) -> None:
        if w.current is r:
            self._try_admit(w, r, False)
            if w.current is None:
                self.prefill_next(w)

    def _try_admit(self, w: SimWorker, r: SimRequest, first: bool) -> None:
        cfg, now = self.cfg, self.now
        d = self.workers[r.dw]
        if not (d.role == DECODE and d.state == ACTIVE):
            d = self.router.pick(DECODE, req=r)  # re-pair (module doc: deviation)
            r.dw, r.decode_id = d.index, d.wid
        if first:
            r.give_up_s = now + max(cfg.admit_timeout_s, r.arrival_s + self.policy.ttft_s - now)
            sfx = 0
            if cfg.fluidtoken and self.budgets:
                view = [r, *islice(w.queue, cfg.policy_queue_window - 1)]
                plan = select_steal_ratios(
                    cast("list[QueuedRequest]", view), self.budgets, self.profile, self.policy, now
                )
                sfx = min(plan.stolen_tokens.get(0, 0), r.prompt - 1)
            r.planned_suffix = sfx
        if not d.admitting:
            retry = cfg.retry_not_admitting_s
        elif d.requests >= cfg.max_num_seqs:
            retry = cfg.retry_batch_full_s
        else:
            sfx = r.planned_suffix
            if sfx > 0 and sfx > self.steal_allowance(d, r.prompt - sfx):
                sfx = 0  # DecodeRole.admit refuses the steal, not the request
                self.refused_steals += 1
            bs = cfg.block_size
            kv = admission_kv_tokens(r.prompt, r.output, cfg.decode_reserve_tokens, self._max_ctx)
            blocks = -(-kv // bs)
            if d.free_blocks >= blocks:
                d.reserved_blocks += blocks
                d.requests += 1
                d.receiving += 1
                r.blocks, r.suffix, r.prefix = blocks, sfx, r.prompt - sfx
                d.suffix_backlog += sfx
                self.push(now + self.profile.prefill_time_s(r.prefix), E_PREFILL_DONE, w, r)
                return
            retry = cfg.retry_no_blocks_s
        if now > r.give_up_s:
            w.current = None
            self.fail(r)
            return
        self.push(now + retry, E_PREFILL_RETRY, w, r)

    def _prefill_done(self, w: SimWorker, r: SimRequest) -> None:
        now = self.now
        w.current = None
        if r.suffix == 0:
            r.t_first = now  # first token sampled and streamed by the prefill worker
        else:
            self.split_requests += 1
        start = now if now > w.link_free_s else w.link_free_s
        arrive = start + self.cfg.kv_transfer_overhead_s + r.prefix * self._kv_s_per_token
        w.link_free_s = arrive
        self.push(arrive, E_KV_ARRIVE, self.workers[r.dw], r)
        self.prefill_next(w)
