"""The worker's policy: the latency profile (recalibrated online from our own step times),
FluidToken's split planner and budgets, and the pressure signals telemetry publishes.

Decode side (eq. 6–8, 14, 16, 17): from a ``DecodeStats`` snapshot, DPI_load, DPI_adm and
the steal budget offered to every prefill worker heard of recently; ``suffix_allowance``
re-checks that budget when an admit proposes a split, and ``chunk_tokens`` caps the prompt
tokens one decode iteration may carry. Prefill side (eq. 3–5): PPI over the queue, and
Algorithm 1 (``split_plan``) over the freshest budgets of the decode workers.

The roles get these as callables in their constructors; telemetry reads ``signals()``.
Event loop only.
"""

from __future__ import annotations

import time
from typing import Any

from services.worker.config import WorkerConfig
from services.worker.metrics import WorkerMetrics
from services.worker.peers import Peers
from services.worker.prefill.prefill_job import PrefillJob
from services.worker.stats import DecodeStats, PrefillStats, PressureSignals
from services.worker.status import WorkerStatus
from shared.engine.profiles import load_profile
from shared.policy.admission import queue_work_s
from shared.policy.config import PolicyConfig
from shared.policy.fluidtoken import select_steal_ratios
from shared.policy.predictors import LatencyProfile
from shared.policy.prefill_pressure import queue_ppi
from shared.policy.pressure import (
    DecodeLoad,
    decode_load_from_pool,
    decode_pressure,
    offered_budget_tokens,
    suffix_allowance_tokens,
    suffix_chunk_tokens,
)
from shared.policy.recalibration import OnlineRecalibrator
from shared.policy.roles import DECODE


def load_policy_config(cfg: WorkerConfig) -> PolicyConfig:
    if cfg.policy_config:
        return PolicyConfig.load(cfg.policy_config)
    return PolicyConfig(ttft_ms=cfg.ttft_slo_ms, tpot_ms=cfg.tpot_slo_ms)


def worker_profile(cfg: WorkerConfig, engine: Any) -> LatencyProfile:
    """The profile this worker predicts with. ``engine`` is Any: ``profile`` is the emulated
    engine's, not StepEngine's (it sleeps profile × time_scale: predict the same times)."""
    if getattr(engine, "profile", None) is not None:
        scaled: LatencyProfile = engine.profile.scaled(cfg.time_scale)
        return scaled
    return load_profile(cfg.profile or "cpu-tiny")


class WorkerPolicy:
    """Holds the profile and the last computed signals; mutated by ``refresh``,
    ``suffix_allowance`` (it refreshes the decode side) and the ``observe_*`` hooks."""

    def __init__(
        self,
        policy: PolicyConfig,
        profile: LatencyProfile,
        peers: Peers,
        status: WorkerStatus,
        metrics: WorkerMetrics,
        *,
        force_steal_ratio: float,
        recalibrate: bool,
        idle_chunk_tokens: int,
    ) -> None:
        self.policy = policy
        self.profile = profile
        # Online recalibration (the paper's future work): refit from our own step times.
        self.recal = OnlineRecalibrator(profile)
        self._peers = peers
        self._status = status
        self._metrics = metrics
        self.force_steal_ratio = force_steal_ratio
        self.recalibrate = recalibrate
        self.idle_chunk_tokens = idle_chunk_tokens
        self.queue_work_s = 0.0
        self.ppi = 0.0
        self.dpi_load = 0.0
        self.dpi_adm = 0.0
        self.steal_budget_tokens = 0.0
        self.tpot_slack_s = 0.0

    def signals(self) -> PressureSignals:
        return PressureSignals(
            self.ppi, self.dpi_load, self.dpi_adm, self.steal_budget_tokens, self.queue_work_s
        )

    # ------------------------------------------------------------ role hooks
    def chunk_tokens(self, context_tokens: int, decoding: bool) -> int:
        """Prompt-chunk tokens one decode iteration may run on a prefix of ``context_tokens``
        without breaking TPOT (eq. 16, shared with the simulator): 0 when there is no slack
        while requests decode; the configured chunk when nothing decodes."""
        return suffix_chunk_tokens(
            self.tpot_slack_s,
            context_tokens,
            self.profile,
            self.policy,
            decoding=decoding,
            idle_chunk_tokens=self.idle_chunk_tokens,
        )

    def split_plan(self, jobs: list[PrefillJob], now_s: float) -> dict[str, int]:
        """Algorithm 1 over ``jobs`` (head first); returns request id -> suffix tokens."""
        forced = self.force_steal_ratio
        if forced >= 0:
            head = jobs[0]
            return {head.request_id: int(forced * head.prompt_len)}
        queue = [j.queued_request() for j in jobs]
        plan = select_steal_ratios(queue, self._peers.budgets, self.profile, self.policy, now_s)
        return {jobs[i].request_id: n for i, n in plan.stolen_tokens.items()}

    def suffix_allowance(
        self, decode: DecodeStats, context_tokens: int, forced: bool = False
    ) -> int:
        """Decode-side re-check: the suffix tokens we accept from a prefill worker now."""
        if self.force_steal_ratio >= 0 or forced:
            return 1 << 30
        self._refresh_decode(decode)
        return suffix_allowance_tokens(
            self.steal_budget_tokens, self.tpot_slack_s, context_tokens, self.profile, self.policy
        )

    # ------------------------------------------------------------ observations
    def observe_prefill(self, prompt_tokens: int, seconds: float) -> None:
        predicted = self.profile.prefill_time_s(prompt_tokens)
        self._metrics.observe_step("prefill", seconds)
        self._error("prefill", predicted, seconds)
        self.recal.observe_prefill(prompt_tokens, seconds)

    def observe_decode(
        self, batch_size: int, context_tokens: int, suffix_tokens: int, seconds: float
    ) -> None:
        self._metrics.observe_step("decode" if suffix_tokens == 0 else "mixed", seconds)
        if suffix_tokens == 0 and batch_size > 0:
            self._error(
                "decode", self.profile.decode_iter_time_s(batch_size, context_tokens), seconds
            )
            self.recal.observe_decode(batch_size, context_tokens, seconds)

    def _error(self, predictor: str, predicted: float, measured: float) -> None:
        if measured > 0:
            self._metrics.set_predictor_error(predictor, abs(predicted - measured) / measured)

    # ----------------------------------------------------------------- signals
    def refresh(self, decode: DecodeStats, prefill: PrefillStats) -> None:
        """Recompute every signal from the roles' snapshots (each telemetry period)."""
        if self.recalibrate:
            self.profile = self.recal.profile()
        self._refresh_decode(decode)
        self._refresh_prefill(prefill)

    def _decode_load(self, dec: DecodeStats) -> DecodeLoad:
        pool = dec.pool
        capacity = pool.usable_blocks * pool.block_size
        # C_reserved = held − active (shared with the simulator: decode_load_from_pool), plus
        # the requests our prefill peers keep waiting for our capacity.
        return decode_load_from_pool(
            capacity,
            capacity - pool.free_blocks * pool.block_size,
            dec.running_kv_tokens,
            dec.num_running,
            dec.num_requests,
            dec.max_num_seqs,
            waiting_kv_tokens=dec.waiting_kv_tokens,
            waiting_requests=dec.waiting_requests,
        )

    def _refresh_decode(self, dec: DecodeStats) -> None:
        peers = self._peers.fresh_prefill_peers(time.monotonic())
        pressure = decode_pressure(
            self._decode_load(dec),
            self.profile,
            self.policy,
            max(1, len(peers)),
            max_batch=dec.max_num_seqs,
        )
        self.dpi_load = pressure.dpi_load
        self.dpi_adm = pressure.dpi_adm
        # Suffix work already accepted and not yet run uses up the same TPOT slack: the
        # budget we offer (and re-check) is what is left of one iteration's worth (eq. 16-17).
        budget = offered_budget_tokens(pressure.steal_budget_tokens, dec.pending_prompt_tokens)
        self.steal_budget_tokens = budget if self._status.role == DECODE else 0.0
        self.tpot_slack_s = pressure.tpot_slack_s

    def _refresh_prefill(self, pf: PrefillStats) -> None:
        running_s = 0.0
        if pf.running_prompt_tokens:
            running_s = self.profile.prefill_time_s(pf.running_prompt_tokens)
        # What a newcomer would wait for (the router predicts TTFT from it): the queue plus
        # what remains of the running prefill.
        remaining_s = running_s
        if pf.running_started_s is not None:
            remaining_s = max(0.0, running_s - (time.time() - pf.running_started_s))
        self.queue_work_s = queue_work_s(
            (q.prompt_tokens for q in pf.queue), self.profile, running_remaining_s=remaining_s
        )
        self.ppi = queue_ppi(
            list(pf.queue),
            self.profile,
            self.policy,
            time.monotonic(),
            running_remaining_s=running_s,
        )
