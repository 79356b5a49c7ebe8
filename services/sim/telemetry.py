"""The simulator's telemetry: every worker's signals every ``telemetry_interval_s`` (PPI,
DPI, steal budgets, the requests waiting for decode admission), the steal re-check at
admission, and the time series sampled for results. A mixin of ``Simulation``
(cluster.py); the controller, switching and migration are control.py.

Mirrors worker/policy.py and worker/decode_waiting.py:

Every worker publishes every ``telemetry_interval_s``. A decode-role worker computes
``decode_pressure`` (eq. 6–8, 14, 16, 17) from its load — C_active = Σ tokens of runnable
requests, C_reserved = blocks reserved for transfers in flight, N = runnable requests, |P| =
prefill-role workers, N_TPOT capped at ``max_num_seqs`` — and publishes ⌊B_steal⌋; a
prefill-role worker publishes PPI (eq. 5) over its queue with the running prefill's full
T_pre as ``running_remaining_s`` (as the worker does). The controller keeps a PPI window per
prefill worker (eq. 20's p95) and forgets it when the worker turns decode.

Only the PPI inspection is bounded (``policy_queue_window`` requests): beyond a few hundred
queued requests the predicted work far exceeds any TTFT budget, so PPI is already ≫ 1 and
Algorithm 1 spends every budget on the first at-risk requests; the bound keeps a saturated
queue from costing O(queue) per 20 ms tick.
"""

from __future__ import annotations

from itertools import islice
from typing import TYPE_CHECKING, cast

from services.sim.events import E_SAMPLE, E_TELEMETRY
from services.sim.workers import SimWorker
from shared.policy.fluidtoken import StealBudget
from shared.policy.prefill_pressure import QueuedRequest, queue_ppi
from shared.policy.pressure import (
    DecodeLoad,
    DecodePressure,
    decode_load_from_pool,
    decode_pressure,
    dpi_adm,
    offered_budget_tokens,
    suffix_allowance_tokens,
)
from shared.policy.roles import DECODE, PREFILL

if TYPE_CHECKING:
    from services.sim.config import SimConfig
    from shared.policy.config import PolicyConfig
    from shared.policy.predictors import LatencyProfile
    from shared.policy.window import KeyedWindows


class Telemetry:
    """Mixin of ``Simulation`` (shares its attributes, declared here for the type checker).
    Mutates the workers' telemetry fields, ``budgets``, ``ppi_windows`` and ``series``."""

    if TYPE_CHECKING:
        cfg: SimConfig
        profile: LatencyProfile
        policy: PolicyConfig
        workers: list[SimWorker]
        budgets: dict[str, StealBudget]
        ppi_windows: KeyedWindows
        series: dict[str, list[float]]
        stolen_since_sample: int
        now: float
        remaining: int

        def push(self, t: float, kind: int, a: object, b: object = None) -> None: ...

    def decode_load(self, d: SimWorker) -> DecodeLoad:
        """The worker's DecodeLoad, by the live worker's formula (decode_load_from_pool),
        with the requests waiting for its admission as of the last telemetry tick."""
        bs = self.cfg.block_size
        return decode_load_from_pool(
            d.num_blocks * bs,
            (d.held_blocks + d.reserved_blocks) * bs,
            d.active_tokens(),
            d.running,
            d.requests,
            self.cfg.max_num_seqs,
            waiting_kv_tokens=d.waiting_kv_tel,
            waiting_requests=d.waiting_tel,
        )

    def count_waiting(self) -> None:
        """Per decode worker, the requests refused for capacity that prefill workers keep
        retrying (``adm_waiting``: computing or computed, not admitted yet) and the KV they
        would reserve: the live decode worker's ``decode_waiting`` (WaitingAdmissions).
        Mutates ``waiting_*_tel``."""
        for w, (n, kv_tokens) in zip(self.workers, self.waiting_by_decode(), strict=True):
            w.waiting_tel, w.waiting_kv_tel = n, kv_tokens

    def waiting_by_decode(self) -> list[tuple[int, int]]:
        """Per worker index: (requests waiting for its decode admission, their KV tokens),
        read off the prefill workers' ``adm_waiting`` now. Pure."""
        out = [(0, 0)] * len(self.workers)
        for w in self.workers:
            for r in w.adm_waiting.values():
                n, kv_tokens = out[r.dw]
                out[r.dw] = (n + 1, kv_tokens + r.reserve_kv_tokens)
        return out

    def decode_signals(self, d: SimWorker, n_peers: int) -> DecodePressure:
        return decode_pressure(
            self.decode_load(d),
            self.profile,
            self.policy,
            max(1, n_peers),
            max_batch=self.cfg.max_num_seqs,
        )

    def steal_allowance(self, d: SimWorker, context_tokens: int) -> int:
        """DecodeRole's re-check at admission (suffix_allowance_tokens, as the worker)."""
        if d.role != DECODE:
            return 0
        n_peers = sum(1 for w in self.workers if w.role == PREFILL)
        sig = self.decode_signals(d, n_peers)
        offered = offered_budget_tokens(sig.steal_budget_tokens, d.suffix_backlog)
        return suffix_allowance_tokens(
            offered, sig.tpot_slack_s, context_tokens, self.profile, self.policy
        )

    def on_telemetry(self) -> None:
        now = self.now
        cfg = self.cfg
        window = cfg.policy_queue_window
        n_peers = sum(1 for w in self.workers if w.role == PREFILL)
        self.count_waiting()
        for w in self.workers:
            w.sent_since = 0
            w.queue_len_tel = w.queue_len()
            w.free_blocks_tel = w.free_blocks
            w.running_tel = w.running
            w.queue_work_tel = 0.0
            if w.role == DECODE:
                if not (cfg.fluidtoken or cfg.fluidrole):
                    # Pressure pairing alone reads DPI_adm only (eq. 8): skip the rest.
                    w.dpi_adm, w.ppi = dpi_adm(self.decode_load(w)), 0.0
                    continue
                sig = self.decode_signals(w, n_peers)
                w.dpi_load, w.dpi_adm, w.ppi = sig.dpi_load, sig.dpi_adm, 0.0
                offered = offered_budget_tokens(sig.steal_budget_tokens, w.suffix_backlog)
                self.budgets[w.wid] = StealBudget(float(int(offered)), now)
                if cfg.fluidrole:
                    self.ppi_windows.forget(w.wid)
                    w.busy_meter.clear()
                continue
            self.budgets.pop(w.wid, None)
            cur = w.current
            running_s = self.profile.prefill_time_s(cur.prompt) if cur is not None else 0.0
            if cfg.pairing == "pressure":
                w.queue_work_tel = w.queued_work_s(self.profile)
            if w.queue or running_s:
                # SimRequest has QueuedRequest's fields: the queue is read in place.
                view = cast("list[QueuedRequest]", islice(w.queue, window))
                w.ppi = queue_ppi(
                    view, self.profile, self.policy, now, running_remaining_s=running_s
                )
            else:
                w.ppi = 0.0
            if cfg.fluidrole:
                self.ppi_windows.add(w.wid, now, w.ppi)
                w.busy_meter.sample(now, w.busy_clock.total_s(now))
                w.prefill_busy_frac = w.busy_meter.fraction()
        if self.remaining:
            self.push(now + cfg.telemetry_interval_s, E_TELEMETRY, None)

    def on_sample(self) -> None:
        s = self.series
        s["t_s"].append(self.now)
        s["prefill_queue"].append(
            float(sum(w.queue_len() for w in self.workers if w.role == PREFILL))
        )
        s["prefill_workers"].append(float(sum(1 for w in self.workers if w.role == PREFILL)))
        s["decode_running"].append(float(sum(w.running for w in self.workers if w.role == DECODE)))
        s["stolen_tokens_per_s"].append(self.stolen_since_sample / self.cfg.sample_interval_s)
        self.stolen_since_sample = 0
        if self.remaining:
            self.push(self.now + self.cfg.sample_interval_s, E_SAMPLE, None)
