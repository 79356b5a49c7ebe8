"""Running the paper's configurations, and the oracle of §III-A.

``run_config`` simulates one configuration (static | token | role | full, or the
``oracle-live`` yardstick of oracle_live.py) on a workload.
``run_oracle`` simulates every window of the workload on its own, fresh cluster under every
static split (1P(W−1)D … (W−1)P1D, or ``splits``) and keeps, per window, the split with the
highest joint attainment (ties: the split closest to half/half, then fewer prefill workers)
— the best static ratio chosen per window in hindsight.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from services.sim.cluster import Simulation
from services.sim.config import ORACLE, ORACLE_LIVE, STATIC, SimConfig, config_for
from services.sim.oracle_live import run_oracle_live
from services.sim.results import SimResult, stitch
from shared.policy.predictors import LatencyProfile
from shared.trace_request import TraceRequest


def run_config(
    trace: Sequence[TraceRequest],
    name: str,
    base: SimConfig,
    profile: LatencyProfile,
    *,
    schedule: Mapping[int, int] | None = None,
) -> SimResult:
    """Simulate ``trace`` under configuration ``name``. ``schedule``: for ``oracle-live``,
    the oracle's splits on this same trace and base (``oracle_schedule``) when the caller
    already has them; without it the oracle is run first. Raises SimConfigError."""
    if name == ORACLE:
        return run_oracle(trace, base, profile)
    if name == ORACLE_LIVE:
        if schedule is None:
            schedule = oracle_schedule(run_oracle(trace, base, profile))
        return run_oracle_live(trace, base, profile, schedule)
    return Simulation(trace, config_for(name, base), profile, label=name).run()


def oracle_schedule(oracle: SimResult) -> dict[int, int]:
    """Window -> prefill workers, the split ``run_oracle`` chose for each window."""
    splits = oracle.notes["oracle_splits"]
    return {int(w): int(v["prefill_workers"]) for w, v in splits.items()}


def run_oracle(
    trace: Sequence[TraceRequest],
    base: SimConfig,
    profile: LatencyProfile,
    splits: Sequence[int] | None = None,
) -> SimResult:
    """Best static split per window (see module doc); ``notes`` names the choice."""
    ttft_s, tpot_s = base.policy.ttft_s, base.policy.tpot_s
    candidates = list(splits) if splits else list(range(1, base.workers))
    half = base.workers / 2
    by_window: dict[int, list[TraceRequest]] = {}
    for t in sorted(trace, key=lambda t: t.arrival_s):
        by_window.setdefault(t.window, []).append(t)
    parts: list[SimResult] = []
    chosen: dict[str, dict[str, float | int]] = {}
    for window, reqs in sorted(by_window.items()):
        best: tuple[tuple[float, float, int], SimResult, int] | None = None
        for p in candidates:
            cfg = config_for(STATIC, replace(base, prefill_workers=p))
            res = Simulation(reqs, cfg, profile, label=f"{p}P{base.workers - p}D").run()
            joint = float(res.attainment(ttft_s, tpot_s)["joint_attainment"])
            key = (joint, -abs(p - half), -p)
            if best is None or key > best[0]:
                best = (key, res, p)
        assert best is not None
        parts.append(best[1])
        chosen[str(window)] = {"prefill_workers": best[2], "joint_attainment": best[0][0]}
    return stitch(ORACLE, parts, {"oracle_splits": chosen})
