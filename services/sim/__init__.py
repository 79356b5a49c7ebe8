"""Discrete-event simulator of a FluidPD cluster (no processes, no torch).

It imports the very policy code the services run (shared.policy: predictors, PPI/DPI,
Algorithm 1, RolePolicy) and the shipped latency profile, and models the data path of the
router, prefill and decode roles, telemetry, the controller and in-place role switches.
One concept per file: cluster.py (``Simulation``: event loop, a run's bookkeeping) composes
prefill_path.py (arrivals, shedding, prefill queue, decode admission and its waiting, prefix
KV send), decode_path.py (KV arrival, decode iterations with suffix chunks, finish),
telemetry.py (signals, steal re-check, series sampling) and control.py (FluidRole,
switching, migration); router.py, workers.py, config.py, results.py, run.py, and
oracle_live.py (the oracle's splits in one continuous run, a yardstick). Entry points:
``Simulation(trace, cfg, profile).run()``, ``run_config``, ``run_oracle``; ``fluidpd bench
sim`` drives them (services/bench/sim.py).
"""

from services.sim.cluster import Simulation, SimulationError
from services.sim.config import CONFIGS, ORACLE, SimConfig, SimConfigError, config_for
from services.sim.results import SimResult
from services.sim.run import run_config, run_oracle

__all__ = [
    "CONFIGS",
    "ORACLE",
    "SimConfig",
    "SimConfigError",
    "SimResult",
    "Simulation",
    "SimulationError",
    "config_for",
    "run_config",
    "run_oracle",
]
