"""Discrete-event simulation of a FluidPD cluster: the event loop and a run's bookkeeping.

``Simulation`` composes the data path (router → prefill → KV transfer → decode) from
prefill_path.py (arrivals, shedding, prefill queue, decode admission and its waiting, prefix
KV send) and decode_path.py (KV arrival, decode iterations with suffix chunks, finish), and
the control plane from telemetry.py (signals, steal re-check, series sampling) and
control.py (FluidRole, switching, migration). Each of those files says what it mirrors of
the real services and where it deliberately deviates.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence

from services.sim.config import SimConfig
from services.sim.control import ControlPlane
from services.sim.decode_path import DecodePath
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
from services.sim.prefill_path import PrefillPath
from services.sim.results import SimResult
from services.sim.router import SimRouter
from services.sim.telemetry import Telemetry
from services.sim.workers import SimRequest, SimWorker, initial_workers
from shared.policy.fluidtoken import StealBudget
from shared.policy.predictors import LatencyProfile
from shared.policy.pressure import admission_kv_tokens
from shared.trace_request import TraceRequest


class SimulationError(RuntimeError):
    """The simulation lost a request (a bug): the event queue ran dry with requests open."""


class Simulation(PrefillPath, DecodePath, Telemetry, ControlPlane):
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
            cfg.workers, cfg.initial_prefill, num_blocks, cfg.policy.window_s
        )
        self.router = SimRouter(
            self.workers,
            cfg.pairing,
            profile,
            cfg.policy.ttft_s,
            cfg.max_num_seqs,
        )
        ordered = sorted(trace, key=lambda t: t.arrival_s)
        self.reqs = [self._request(i, t) for i, t in enumerate(ordered)]
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

    def _request(self, idx: int, t: TraceRequest) -> SimRequest:
        """The simulated request of trace entry ``t``, with the decode reservation every
        admission, re-pair and pairing counts (the worker's formula, in blocks)."""
        kv = admission_kv_tokens(
            t.prompt_tokens,
            t.output_tokens,
            self.cfg.decode_reserve_tokens,
            self.profile.max_context_tokens,
        )
        return SimRequest(
            idx,
            t.arrival_s,
            t.prompt_tokens,
            t.output_tokens,
            t.source,
            t.window,
            reserve_kv_tokens=kv,
            reserve_blocks=-(-kv // self.cfg.block_size),
        )

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
