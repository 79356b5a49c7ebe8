"""FluidRole switching policy (paper §IV-C2, eq. 20–23) as a small state-holding class.

The controller builds a ``ClusterSnapshot`` every decision interval (cfg.decision_interval_s)
and calls ``RolePolicy.decide(snapshot, now_s)``; the returned ``Decision`` carries every
input and the reason, for logging, whether or not it switches.

Two rule sets (``cfg.rules``): PAPER applies eq. 22–23 literally and moves one worker per
decision after a fixed cooldown; ADAPTIVE (the default) adds the DPI_adm extensions of
rule 5, sizes a move (shared/policy/fluidrole_sizing.py) and replaces the fixed cooldown
by settle-time hysteresis (rule 3). docs/results.md says where and why they differ.

Rules, in the order they are checked:

1. paused (operator ``fluidpd ctl policy pause``) → no switch.
2. a switch in progress (any worker in Drain or Switch) → no switch: one decision's moves
   at a time.
3. PAPER: within T_cooldown of the last switch → no switch. ADAPTIVE: a move the same way
   as the last one waits ``settle_s`` after the last moment a worker was seen in transit
   (its effect must first show in the windowed signals); a move against the last one waits
   ``reverse_wait_s`` from then (oscillation guard), ``reverse_wait_binds_s`` for a P→D
   move while decode binds (the router sheds on the decode backlog meanwhile). A D→P
   follow-up to a move its bounds cut short (fewer workers than PPI̅'s gap, up to
   ``max_move_workers``) does not settle (``d2p_follow_shortfall``): the gap was known,
   what held it back is the decode backlog, re-checked at every decision. Nor does a P→D
   follow-up while decode binds (``p2d_follow_binds``): the router sheds on the decode
   backlog meanwhile, and the test is re-made at every decision.
   In 1–3 the persistence counter is reset, so a switch needs N_persist fresh intervals
   after the cooldown (signals measured mid-transition do not count); ADAPTIVE's one
   exception: a P→D follow-up counts during ``settle_s`` (``p2d_persist_while_settling``)
   and so fires as the settle ends.
4. aggregates over Active workers only: PPI̅ = max_p PPI^95(p) (eq. 20); DPI̅_load, DPI̅_adm =
   means over decode workers (eq. 21). A role with no Active worker contributes 0.
   ADAPTIVE reads DPI̅_adm smoothed like PPI̅: the ``adm_smoothing_q`` percentile (median)
   of the per-decision values over ``window_s`` (the instantaneous value jumps to 1 whenever
   the batch slots are full); its D→P guard reads the larger of smoothed and instantaneous.
5. recommendation (fluidrole_rules.py): D→P if PPI̅ > PPI_high ∧ DPI̅_load < DPI_load^high (eq. 22); else P→D if
   DPI̅_adm > DPI_adm^high ∧ PPI̅ < PPI_low (eq. 23). Eq. 22 and 23 exclude each other when
   PPI_low <= PPI_high. If prefill needs capacity (PPI̅ > PPI_high) but eq. 22's decode
   guard fails (DPI̅_load >= DPI_load^high), both phases are pressured → no switch (reason
   ``both_phases_pressured``: insufficient aggregate capacity, a case for admission control).
   Decode pressured while prefill sits in the hysteresis band [PPI_low, PPI_high] →
   ``prefill_not_idle``. ADAPTIVE only: eq. 22 also needs DPI̅_adm below the admission
   guard, a saturated decode admission (DPI̅_adm >= DPI_adm^blocking, or
   ``waiting_saturates_adm``: ``blocked_waiting_batches`` batches waiting on every decode
   worker, which the smoothed DPI̅_adm lags) under prefill pressure recommends P→D
   (``decode_admission_blocks_prefill``), and so does a decode
   batch near its TPOT-safe size (DPI̅_load > ``p2d_load_trigger``) while PPI̅ < PPI_low
   (``decode_load_pressure``: DPI_adm only rises once the slots are full); but a saturated
   decode admission with fewer than ``blocked_waiting_batches`` batches waiting on some
   decode worker is ``both_phases_short`` (no move: decode keeps up, the prefill queue is
   prefill's own). Where the rules
   recommend nothing, ADAPTIVE reads them again with PPI̅ as it is now (``prefill_ppi_now``:
   the prefill workers' latest PPI) and takes a P→D answer (eq. 20's window keeps a
   drained queue's peak for ``window_s``); D→P still needs the windowed PPI̅.
6. the same recommendation must hold for N_persist consecutive intervals. ADAPTIVE:
   ``n_persist_blocked`` for ``decode_admission_blocks_prefill``, and ``n_persist_binds``
   (1) for any P→D while decode binds (``DecodeDemand.binds``: computed prompts wait for
   decode slots and the router sheds on the decode backlog, so waiting only sheds more).
7. never empty a role: the source role needs >= 2 Active workers (and keeps >= 1).
8. PAPER moves one worker, ADAPTIVE ``move_size`` workers (possibly none: D→P
   ``decode_headroom`` — the decode side's predicted load after even one move is too high,
   the decode backlog read as the larger of now and where the decode flow settles
   (decode_flow.py: the policy's meter over the workers' ``decode_counters``, when
   ``decode_flow_window_s`` > 0; ``Decision.decode_flow``);
   P→D ``prefill_headroom`` — the prefill workers' predicted busy fraction would be, unless
   the decode backlog exceeds every decode slot); candidates with least expected drain:
   D→P — fewest active decode requests (the paper's proxy), then fewest KV tokens in use;
   P→D — least running prefill work (tokens), then shortest queue. Ties break on worker
   id, so decisions are deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

# What the policy reads of the cluster (views, snapshot, pure reads); importable from here too.
from shared.policy.cluster_view import ClusterSnapshot as ClusterSnapshot
from shared.policy.cluster_view import WorkerView as WorkerView
from shared.policy.cluster_view import aggregate_pressure as aggregate_pressure
from shared.policy.cluster_view import decode_demand as decode_demand
from shared.policy.cluster_view import decode_waiting_batches as decode_waiting_batches
from shared.policy.cluster_view import pick_candidates as pick_candidates
from shared.policy.cluster_view import prefill_busy_mean as prefill_busy_mean
from shared.policy.cluster_view import prefill_ppi_now as prefill_ppi_now
from shared.policy.config import PAPER, PolicyConfig
from shared.policy.decision import Decision as Decision
from shared.policy.decode_flow import DecodeFlow, DecodeFlowMeter

# The rules (eq. 22–23 and extensions) live in fluidrole_rules.py; importable from here too.
from shared.policy.fluidrole_rules import D2P as D2P
from shared.policy.fluidrole_rules import NONE as NONE
from shared.policy.fluidrole_rules import P2D as P2D
from shared.policy.fluidrole_rules import recommend as recommend
from shared.policy.fluidrole_sizing import d2p_gap, move_size

# The vocabulary is roles.py's; these names stay importable from here for the policy's users.
from shared.policy.roles import ACTIVE, DECODE, PREFILL
from shared.policy.roles import DRAIN as DRAIN
from shared.policy.roles import SWITCH as SWITCH
from shared.policy.window import SlidingWindow


class RolePolicy:
    """Persistence counter, cooldown and last switch time around eq. 22–23. Mutable.

    ``decide`` is the only state-changing call (besides ``paused``); it does no I/O. When it
    returns a switch, it assumes the controller issues it at ``now_s`` (cooldown starts).
    """

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg
        self.paused = False
        self.last_switch_s: float | None = None
        self.last_action = NONE
        self._last_transit_s: float | None = None  # last decide() that saw a switch running
        self._pending = NONE
        self._count = 0
        self._d2p_shortfall = 0  # workers the last D->P move's bounds held back (ADAPTIVE)
        self._adm_window = SlidingWindow(cfg.window_s)  # DPI̅_adm per decision (ADAPTIVE)
        self._flow: DecodeFlowMeter | None = None  # the decode flow (ADAPTIVE, decode_flow.py)
        if cfg.rules != PAPER and cfg.decode_flow_window_s > 0:
            self._flow = DecodeFlowMeter(cfg.decode_flow_window_s)

    def smoothed_adm(self, adm_now: float, now_s: float) -> float:
        """Record this decision's DPI̅_adm and return the value FluidRole reads (rule 4):
        the instantaneous one under PAPER or ``adm_smoothing_q`` 0, else that percentile of
        the window. Mutates the window."""
        if self.cfg.rules == PAPER or self.cfg.adm_smoothing_q <= 0:
            return adm_now
        self._adm_window.add(now_s, adm_now)
        return self._adm_window.percentile(now_s, self.cfg.adm_smoothing_q) or 0.0

    def measure_flow(
        self, workers: Sequence[WorkerView], backlog: int, now_s: float
    ) -> DecodeFlow | None:
        """Feed the decode flow meter this decision's counters and backlog; the flow (None
        without a meter). Mutates the meter."""
        if self._flow is None:
            return None
        for w in workers:
            if w.decode_counters is not None:
                self._flow.observe(w.worker_id, w.decode_counters)
        return self._flow.sample(now_s, backlog)

    def decide(self, snapshot: ClusterSnapshot, now_s: float) -> Decision:
        cfg = self.cfg
        workers = snapshot.workers
        demand = decode_demand(workers)
        flow = self.measure_flow(workers, demand.requests, now_s)
        if flow is not None:
            demand = replace(demand, forecast_requests=flow.requests)
        ppi_bar, load_bar, adm_now, n_p, n_d = aggregate_pressure(workers)
        adm_bar = self.smoothed_adm(adm_now, now_s)
        adm_d2p = max(adm_bar, adm_now)  # the D->P guard also heeds a fresh spike
        ppi_now = prefill_ppi_now(workers)
        waiting = None if cfg.rules == PAPER else decode_waiting_batches(workers)
        rec, reason = recommend(
            ppi_bar,
            load_bar,
            adm_bar,
            cfg,
            adm_guard_value=adm_d2p,
            ppi_now=ppi_now,
            decode_waiting_batches=waiting,
        )
        # A P->D recommendation while decode binds (the backlog, or its forecast, needs more
        # decode workers than the Active ones even with every slot full): ADAPTIVE then
        # waits less before moving back, does not settle, and persists n_persist_binds.
        p2d_binds = cfg.rules != PAPER and rec == P2D and demand.binds(n_d)

        def out(action: str, why: str, movers: Sequence[WorkerView] = ()) -> Decision:
            target = None
            if movers:
                target = PREFILL if action == D2P else DECODE
            return Decision(
                now_s=now_s,
                action=action,
                worker_id=movers[0].worker_id if movers else None,
                target_role=target,
                reason=why,
                recommendation=rec,
                persist_count=self._count,
                ppi_bar=ppi_bar,
                dpi_load_bar=load_bar,
                dpi_adm_bar=adm_bar,
                active_prefill=n_p,
                active_decode=n_d,
                worker_ids=tuple(w.worker_id for w in movers),
                decode_flow=flow,
                ppi_now=ppi_now,
                dpi_adm_guard=None if cfg.rules == PAPER else adm_d2p,
                decode_waiting_batches=waiting,
            )

        gate = None
        if self.paused:
            gate = "paused"
        elif any(w.state != ACTIVE for w in workers):
            self._last_transit_s = now_s
            gate = "switch_in_progress"
        elif self.last_switch_s is not None:
            since_s = now_s - max(self.last_switch_s, self._last_transit_s or self.last_switch_s)
            if cfg.rules == PAPER:
                if now_s - self.last_switch_s < cfg.cooldown_s:
                    gate = "cooldown"
            elif rec != NONE and rec == self.last_action:
                # No settle for a D->P follow-up its bounds cut short, nor for a P->D one
                # while decode binds (config.py: d2p_follow_shortfall, p2d_follow_binds).
                follow = (rec == D2P and self._d2p_shortfall > 0) or (
                    p2d_binds and cfg.p2d_follow_binds
                )
                if since_s < cfg.settle_s and not follow:
                    gate = "settling"
            elif rec != NONE:
                wait_s = cfg.reverse_wait_s
                if p2d_binds:
                    wait_s = min(wait_s, cfg.reverse_wait_binds_s)
                if since_s < wait_s:
                    gate = "cooldown"
        # A P->D follow-up counts its persistence while settling, but does not move: it
        # fires as the settle ends (config.py). Every other gate resets the count.
        count_only = gate == "settling" and rec == P2D and cfg.p2d_persist_while_settling
        if (gate is not None and not count_only) or rec == NONE:
            self._pending, self._count = NONE, 0
            return out(NONE, gate or reason)

        self._count = self._count + 1 if rec == self._pending else 1
        self._pending = rec
        if gate is not None:  # count_only: settling
            return out(NONE, gate)
        blocked = cfg.rules != PAPER and reason == "decode_admission_blocks_prefill"
        n_persist = cfg.n_persist_blocked if blocked else cfg.n_persist
        if p2d_binds:
            n_persist = min(n_persist, cfg.n_persist_binds)  # decode binds: unambiguous
        if self._count < n_persist:
            return out(NONE, f"persisting_{self._count}_of_{n_persist}")
        source_active = n_d if rec == D2P else n_p
        if source_active < 2:
            return out(NONE, "would_empty_role")
        k = 1
        if cfg.rules != PAPER:
            k = move_size(
                rec,
                ppi_bar,
                load_bar,
                adm_d2p if rec == D2P else adm_bar,
                n_p,
                n_d,
                cfg,
                decode_blocked=blocked,
                demand=demand,
                prefill_busy=prefill_busy_mean(workers),
            )
            if k == 0:  # even one worker would leave its role over its predicted load
                self._pending, self._count = NONE, 0
                return out(NONE, "decode_headroom" if rec == D2P else "prefill_headroom")
        movers = pick_candidates(workers, rec, k)
        if not movers:  # unreachable: source_active >= 2
            return out(NONE, "no_candidate")
        self._d2p_shortfall = 0
        if rec == D2P and cfg.rules != PAPER and cfg.d2p_follow_shortfall:
            gap = min(d2p_gap(ppi_bar, n_p, cfg), cfg.max_move_workers)
            self._d2p_shortfall = max(0, gap - len(movers))
        decision = out(rec, reason, movers)
        self.last_switch_s = now_s
        self.last_action = rec
        self._pending, self._count = NONE, 0
        return decision
