"""The simulator's control plane: FluidRole (1 s), switching, migration; the telemetry it
reads (20 ms) is telemetry.py.

Mirrors controller/status.py + controller.py and worker/role_switch/switch.py:

* Controller: every ``decision_interval_s`` a ClusterSnapshot goes to ``RolePolicy.decide``
  (eq. 20–23, N_persist, cooldown/settling, one decision's moves at a time, never empty a
  role); every worker the decision names starts its switch at once.
* Switch: Drain → Switch → Active. P→D hands queued requests round-robin to the other
  Active prefill workers, finishes the running prefill and waits for its link to go idle.
  D→P stops admission and waits for every decode request to finish — or, with
  ``migrate_on_drain``, moves each running decode (at an iteration boundary) to the Active
  decode worker with the most free blocks, its KV (tokens so far) over the link; it is
  cancelled after ``drain_timeout_s``. The flip itself costs ``switch_overhead_s``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.sim.events import (
    E_CONTROL,
    E_DRAIN_CHECK,
    E_DRAIN_TIMEOUT,
    E_MIGRATE_ARRIVE,
    E_SAMPLE,
    E_SWITCH_DONE,
    E_TELEMETRY,
)
from services.sim.workers import SimRequest, SimWorker
from shared.policy.decode_flow import FlowCounters
from shared.policy.fluidrole import ClusterSnapshot, RolePolicy, WorkerView
from shared.policy.roles import ACTIVE, DECODE, DRAIN, PREFILL, SWITCH
from shared.policy.window import KeyedWindows

if TYPE_CHECKING:
    from services.sim.config import SimConfig
    from shared.policy.config import PolicyConfig
    from shared.policy.predictors import LatencyProfile


class ControlPlane:
    """Mixin of ``Simulation`` (shares its attributes, declared here for the type checker)."""

    if TYPE_CHECKING:
        cfg: SimConfig
        profile: LatencyProfile
        policy: PolicyConfig
        workers: list[SimWorker]
        reqs: list[SimRequest]
        now: float
        remaining: int
        _kv_s_per_token: float

        def push(self, t: float, kind: int, a: object, b: object = None) -> None: ...
        def start_iter(self, d: SimWorker) -> None: ...
        def prefill_next(self, w: SimWorker) -> None: ...

    def init_control(self) -> None:
        self.role_policy = RolePolicy(self.policy)
        self.ppi_windows = KeyedWindows(self.policy.window_s)
        self.switches: list[dict[str, Any]] = []
        self.migrations = 0
        self.stolen_since_sample = 0
        self.series: dict[str, list[float]] = {
            "t_s": [],
            "prefill_queue": [],
            "prefill_workers": [],
            "stolen_tokens_per_s": [],
            "decode_running": [],
        }

    def start_ticks(self) -> None:
        t0 = self.reqs[0].arrival_s
        if self.cfg.needs_telemetry:
            self.push(t0, E_TELEMETRY, None)
        if self.cfg.fluidrole:
            self.push(t0 + self.policy.decision_interval_s, E_CONTROL, None)
        self.push(t0, E_SAMPLE, None)

    # ------------------------------------------------------------- controller
    def on_control(self) -> None:
        now = self.now
        bs = self.cfg.block_size
        views = []
        for w in self.workers:
            views.append(
                WorkerView(
                    worker_id=w.wid,
                    role=w.role,
                    state=w.state,
                    ppi_p95=(self.ppi_windows.p95(w.wid, now) or 0.0) if w.role == PREFILL else 0.0,
                    ppi_now=w.ppi if w.role == PREFILL else 0.0,
                    dpi_load=w.dpi_load,
                    dpi_adm=w.dpi_adm,
                    active_decode_requests=w.running_tel,
                    kv_active_tokens=(w.num_blocks - w.free_blocks_tel) * bs,
                    running_prefill_tokens=w.current.prompt if w.current is not None else 0,
                    prefill_busy_frac=w.prefill_busy_frac if w.role == PREFILL else 0.0,
                    queue_len=w.queue_len_tel,
                    decode_waiting=w.waiting_tel if w.role == DECODE else 0,
                    max_decode_requests=self.cfg.max_num_seqs if w.role == DECODE else 0,
                    decode_counters=FlowCounters(w.dec_entered, w.dec_left),
                )
            )
        decision = self.role_policy.decide(ClusterSnapshot(tuple(views)), now)
        if decision.switches and decision.target_role:
            for wid in decision.worker_ids:  # ADAPTIVE rules may move several at once
                worker = next(w for w in self.workers if w.wid == wid)
                self.start_switch(worker, decision.target_role)
        if self.remaining:
            self.push(now + self.policy.decision_interval_s, E_CONTROL, None)

    # ---------------------------------------------------------------- switching
    def start_switch(self, w: SimWorker, target: str) -> None:
        """Active(role) → Drain (worker/role_switch/switch.py ``_run``). Mutates workers and queues."""
        now = self.now
        w.state = DRAIN
        w.target_role = target
        w.switch_epoch += 1
        w.drain_started_s = now
        self.push(now + self.cfg.drain_timeout_s, E_DRAIN_TIMEOUT, w, w.switch_epoch)
        if w.role == PREFILL:
            jobs = list(w.queue)
            w.queue.clear()
            targets = [x for x in self.workers if x is not w and x.is_active(PREFILL)]
            for i, r in enumerate(jobs):
                t = targets[i % len(targets)]
                r.pw = t.index
                t.queue.append(r)
            for t in targets:
                if t.current is None and t.queue:
                    self.prefill_next(t)
        else:
            w.admitting = False
            if self.cfg.migrate_on_drain and not w.busy:
                self.migrate_all(w)
        self.check_drain(w)

    def check_drain(self, w: SimWorker) -> None:
        """Drain → Switch once the role's in-flight work (and the link) is done."""
        if w.state != DRAIN:
            return
        # Computed prompts waiting for a decode reservation do not hold a P→D switch (it
        # adds the capacity they wait for): they keep their blocks and wait on (switch.py).
        drained = w.current is None and not w.queue if w.role == PREFILL else w.requests == 0
        if not drained:
            return
        if w.link_free_s > self.now:
            self.push(w.link_free_s, E_DRAIN_CHECK, w)
            return
        w.state = SWITCH
        self.push(self.now + self.cfg.switch_overhead_s, E_SWITCH_DONE, w, w.switch_epoch)

    def on_switch_done(self, w: SimWorker, epoch: int) -> None:
        if w.state != SWITCH or epoch != w.switch_epoch:
            return
        old = w.role
        w.role = w.target_role
        w.state = ACTIVE
        w.admitting = True
        w.ppi = w.dpi_load = w.dpi_adm = 0.0
        self.switches.append(
            {
                "t_s": round(self.now, 3),
                "worker": w.wid,
                "from": old,
                "to": w.role,
                "drain_s": round(
                    max(0.0, self.now - w.drain_started_s - self.cfg.switch_overhead_s), 4
                ),
            }
        )
        if w.role == DECODE and w.pending:  # cannot happen (a prefill had no decodes)
            self.start_iter(w)

    def on_drain_timeout(self, w: SimWorker, epoch: int) -> None:
        if w.state == DRAIN and epoch == w.switch_epoch:
            w.state = ACTIVE  # switch cancelled: back to Active in the old role
            w.admitting = True
            self.switches.append(
                {"t_s": round(self.now, 3), "worker": w.wid, "cancelled": True, "role": w.role}
            )

    # ---------------------------------------------------------------- migration
    def migrate_all(self, d: SimWorker) -> None:
        """Move every running decode of draining ``d`` to a peer (at an iteration boundary).
        A request stays when no Active decode peer has room for it."""
        movers = [*d.batch_members(), *d.pending]
        if not movers:
            return
        peers = [x for x in self.workers if x is not d and x.is_active(DECODE)]
        for r in movers:
            fits = [
                p for p in peers if p.free_blocks >= r.blocks and p.requests < self.cfg.max_num_seqs
            ]
            if not fits:
                continue
            t = max(fits, key=lambda p: (p.free_blocks, -p.index))
            if r in d.pending:
                d.pending.remove(r)
                d.pending_tokens -= r.ntok
            else:
                d.leave_batch(r)
            d.release(r)
            t.reserved_blocks += r.blocks
            t.requests += 1
            t.receiving += 1
            r.dw = t.index
            start = max(self.now, d.link_free_s)
            arrive = start + self.cfg.kv_transfer_overhead_s + r.ntok * self._kv_s_per_token
            d.link_free_s = arrive
            self.push(arrive, E_MIGRATE_ARRIVE, t, r)
            self.migrations += 1

    def on_migrate_arrive(self, t: SimWorker, r: SimRequest) -> None:
        t.reserved_blocks -= r.blocks
        t.held_blocks += r.blocks
        t.receiving -= 1
        t.dec_entered += 1  # the decode flow (workers.py)
        t.pending.append(r)
        t.pending_tokens += r.ntok
        if not t.busy:
            self.start_iter(t)
