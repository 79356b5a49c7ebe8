"""The oracle's schedule, run live: a yardstick for how much of ``full − oracle`` any live
system could close.

The oracle (run.py) runs every window on its own, *empty* cluster at that window's best
static split. No live system gets that clean start: when a stage begins, the previous
stage's requests are still queued and decoding. ``oracle-live`` replays the whole trace as
ONE continuous run with ``full``'s data path (pressure pairing, FluidToken, the door), but
FluidRole's decisions are replaced by a clairvoyant schedule: the oracle's split for each
window, applied the moment the window's first request has arrived (checked every
``SCRIPT_TICK_S``), through the real switch mechanics (Drain, migration of running
decodes, ``switch_overhead_s``). It knows the future split exactly and reacts at once; what
it cannot do is skip the backlog the previous stage leaves behind.

So ``oracle − oracle-live`` is the clean-start premium of the per-window oracle (what the
live system is held to beyond knowing the splits), and ``full − oracle-live`` compares
FluidRole's own decisions with the clairvoyant schedule. Not a configuration of the live
cluster: a simulator-only yardstick (``fluidpd bench sim --config oracle-live``,
``fluidpd bench sim-sweep --configs …,oracle-live``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from services.sim.cluster import Simulation
from services.sim.config import FULL, ORACLE_LIVE, SimConfig, config_for
from services.sim.events import E_CONTROL
from services.sim.results import SimResult
from shared.policy.predictors import LatencyProfile
from shared.policy.roles import ACTIVE, DECODE, PREFILL
from shared.trace_request import TraceRequest

# How often the schedule is checked, simulated seconds: a tenth of FluidRole's decision
# interval, so the schedule lags a stage edge by at most this much.
SCRIPT_TICK_S = 0.1
# The result's notes key naming the schedule it followed (``schedule_json``).
SCHEDULE_NOTE = "schedule_prefill_workers"


class ScheduledRoles(Simulation):
    """A Simulation whose control plane follows ``prefill_by_window`` (window -> Active
    prefill workers) instead of FluidRole. Mutates workers through ``start_switch`` only.
    Raises ValueError when ``cfg.fluidrole`` is off: its control ticks drive the schedule."""

    def __init__(
        self,
        trace: Sequence[TraceRequest],
        cfg: SimConfig,
        profile: LatencyProfile,
        prefill_by_window: Mapping[int, int],
        label: str = ORACLE_LIVE,
    ) -> None:
        if not cfg.fluidrole:
            raise ValueError("ScheduledRoles needs cfg.fluidrole (its control ticks)")
        super().__init__(trace, cfg, profile, label=label)
        self.prefill_by_window = dict(prefill_by_window)

    def on_control(self) -> None:
        """Move workers toward the split of the latest arrived request's window; one set of
        moves at a time (none while a worker is in Drain or Switch)."""
        arrived = self._next_arrival  # the arrivals handled so far (prefill_path.py)
        want = self.prefill_by_window.get(self.reqs[arrived - 1].window) if arrived else None
        if want is not None and all(w.state == ACTIVE for w in self.workers):
            prefill = [w for w in self.workers if w.role == PREFILL]
            if len(prefill) < want:
                # Fewest requests to drain first (FluidRole's D->P proxy, by local counts).
                decode = [w for w in self.workers if w.role == DECODE]
                movers = sorted(decode, key=lambda w: (w.requests, w.index))[: want - len(prefill)]
                target = PREFILL
            else:
                surplus = len(prefill) - want  # 0: nothing to move
                movers = sorted(prefill, key=lambda w: (len(w.queue), w.index))[:surplus]
                target = DECODE
            for w in movers:
                self.start_switch(w, target)
        if self.remaining:
            self.push(self.now + SCRIPT_TICK_S, E_CONTROL, None)


def run_oracle_live(
    trace: Sequence[TraceRequest],
    base: SimConfig,
    profile: LatencyProfile,
    prefill_by_window: Mapping[int, int],
) -> SimResult:
    """One continuous run of ``trace`` under ``full``'s data path with the given schedule
    (module doc). ``notes`` names the schedule. Raises SimConfigError, SimulationError."""
    first = min(trace, key=lambda t: t.arrival_s).window if trace else 0
    cfg = config_for(FULL, base)
    cfg = replace(cfg, prefill_workers=prefill_by_window.get(first, cfg.initial_prefill))
    res = ScheduledRoles(trace, cfg, profile, prefill_by_window).run()
    res.notes = {SCHEDULE_NOTE: schedule_json(prefill_by_window)}
    return res


def schedule_json(prefill_by_window: Mapping[int, int]) -> dict[str, int]:
    """A schedule as JSON stores it: {"<window>": prefill workers}, windows in order."""
    return {str(w): int(p) for w, p in sorted(prefill_by_window.items())}


def schedule_from_json(doc: Mapping[str, int]) -> dict[int, int]:
    """The inverse of ``schedule_json``."""
    return {int(w): int(p) for w, p in doc.items()}
