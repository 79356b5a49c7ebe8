"""Worker telemetry: pressure signals out (every ~20 ms), steal budgets in.

Decode side (eq. 6–8, 14, 16, 17): from block-manager and batch state, publishes DPI_load,
DPI_adm and a steal budget for every prefill worker it has heard from recently.
Prefill side (eq. 3–5): publishes PPI over its queue, and keeps the freshest budget of each
decode worker for Algorithm 1, which ``split_plan`` runs on every prefill iteration.

Times here are this process's monotonic clock: a budget's age is measured from when we
received it, so clock skew between hosts cannot make a budget look fresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

import structlog

from services.worker.decode_choice import DecodeView
from services.worker.prefill_job import PrefillJob
from shared.bus import ServeHandle
from shared.engine.profiles import load_profile
from shared.messages import WorkerTelemetry
from shared.policy.admission import queue_work_s
from shared.policy.config import PolicyConfig
from shared.policy.fluidtoken import StealBudget, select_steal_ratios
from shared.policy.predictors import LatencyProfile
from shared.policy.pressure import (
    DecodeLoad,
    QueuedRequest,
    decode_load_from_pool,
    decode_pressure,
    offered_budget_tokens,
    queue_ppi,
    suffix_allowance_tokens,
    suffix_chunk_tokens,
)
from shared.policy.recalibration import OnlineRecalibrator

if TYPE_CHECKING:
    from services.worker.runtime import WorkerRuntime

log = structlog.get_logger(__name__)

_PEER_FRESH_S = 2.0  # a prefill worker unheard of for this long no longer shares budgets


class Telemetry:
    def __init__(self, rt: WorkerRuntime) -> None:
        self.rt = rt
        cfg = rt.cfg
        self.policy = (
            PolicyConfig.load(cfg.policy_config)
            if cfg.policy_config
            else PolicyConfig(ttft_ms=cfg.ttft_slo_ms, tpot_ms=cfg.tpot_slo_ms)
        )
        self.profile: LatencyProfile = self._profile()
        # Online recalibration (the paper's future work): refit from our own step times.
        self.recal = OnlineRecalibrator(self.profile)
        self.budgets: dict[str, StealBudget] = {}
        # Prefill side: each decode worker's last word on its admission capacity (re-pairing
        # a request that waits for decode capacity, decode_choice.py).
        self.decode_views: dict[str, DecodeView] = {}
        self.queue_work_s = 0.0
        self.prefill_peers: dict[str, float] = {}
        self.ppi = 0.0
        self.dpi_load = 0.0
        self.dpi_adm = 0.0
        self.steal_budget_tokens = 0.0
        self.max_suffix_tokens = 0.0
        self.tpot_slack_s = 0.0
        self._task: asyncio.Task[None] | None = None
        self._peers_sub: ServeHandle | None = None
        self._peers_role = ""
        self.subscribe_hooks_ready = False

    def _profile(self) -> LatencyProfile:
        eng: Any = self.rt.engine  # `profile` is the emulated engine's, not StepEngine's
        if getattr(eng, "profile", None) is not None:
            # The emulated engine sleeps profile × time_scale: predict the same times.
            return eng.profile.scaled(self.rt.cfg.time_scale)
        return load_profile(self.rt.cfg.profile or "cpu-tiny")

    def install_policy(self) -> None:
        """Give the roles their policy hooks (split planner, decode budget re-check)."""
        if self.rt.cfg.fluidtoken:
            self.rt.prefill.split_planner = self.split_plan
            self.rt.decode._suffix_budget = self.suffix_allowance
            self.rt.decode.chunk_budget = self.chunk_tokens

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
            idle_chunk_tokens=self.rt.decode.prefill_chunk_tokens,
        )

    async def start(self) -> None:
        await self.follow_role(self.rt.role)
        self._task = asyncio.ensure_future(self._publish_loop())

    async def follow_role(self, role: str) -> None:
        """Listen to the telemetry ``role`` uses, and only to it: a prefill worker reads the
        decode workers' steal budgets, a decode worker which prefill workers are alive (it
        offers each one a budget). Idempotent; the role switch calls it with the new role.
        (Each worker used to decode every worker's telemetry, its own included: 50 messages
        a second per worker, half of them unused.)"""
        if role == self._peers_role:
            return
        if self._peers_sub is not None:
            await self._peers_sub.stop()
        other = "decode" if role == "prefill" else "prefill"
        self._peers_role = role
        self._peers_sub = await self.rt.bus.subscribe_stream(
            self.rt.subjects.telemetry(other, "*"), WorkerTelemetry, self._on_peer
        )

    async def stop(self) -> None:
        if self._peers_sub is not None:
            await self._peers_sub.stop()
            self._peers_sub = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    # ----------------------------------------------------------------- inbound
    async def _on_peer(self, msg: WorkerTelemetry) -> None:
        if msg.publisher_id == self.rt.cfg.worker_id:
            return
        now = time.monotonic()
        if msg.role == "prefill":
            self.prefill_peers[msg.publisher_id] = now
        elif msg.role == "decode":
            tokens = msg.steal_budgets.get(self.rt.cfg.worker_id, 0)
            self.budgets[msg.publisher_id] = StealBudget(float(tokens), now)
            m = msg.metrics
            self.decode_views[msg.publisher_id] = DecodeView(
                now,
                msg.free_blocks,
                msg.running + int(m.get("receiving", 0)),
                int(m.get("decode_waiting", 0)),
                int(m.get("decode_waiting_blocks", 0)),
            )

    # ---------------------------------------------------------------- policies
    def _queue_view(self, jobs: list[PrefillJob]) -> list[QueuedRequest]:
        # Deadlines follow the policy's TTFT SLO (eq. 1) from each request's real arrival.
        return [
            QueuedRequest(j.request_id, j.arrival_s, j.prompt_len, j.msg.decode_worker_id)
            for j in jobs
        ]

    def split_plan(self, jobs: list[PrefillJob], now_s: float) -> dict[str, int]:
        """Algorithm 1 over ``jobs`` (head first); returns request id -> suffix tokens."""
        forced = self.rt.cfg.force_steal_ratio
        if forced >= 0:
            head = jobs[0]
            return {head.request_id: int(forced * head.prompt_len)}
        plan = select_steal_ratios(
            self._queue_view(jobs), self.budgets, self.profile, self.policy, now_s
        )
        return {jobs[i].request_id: n for i, n in plan.stolen_tokens.items()}

    def suffix_allowance(
        self, prefill_worker_id: str, context_tokens: int, forced: bool = False
    ) -> int:
        """Decode-side re-check: the suffix tokens we accept from that prefill worker now."""
        if self.rt.cfg.force_steal_ratio >= 0 or forced:
            return 1 << 30
        self._refresh_decode()
        return suffix_allowance_tokens(
            self.steal_budget_tokens, self.tpot_slack_s, context_tokens, self.profile, self.policy
        )

    # ------------------------------------------------------------ observations
    def observe_prefill(self, prompt_tokens: int, seconds: float) -> None:
        predicted = self.profile.prefill_time_s(prompt_tokens)
        self.rt.metrics.step.labels(self.rt.cfg.worker_id, "prefill").observe(seconds)
        self._error("prefill", predicted, seconds)
        self.recal.observe_prefill(prompt_tokens, seconds)

    def observe_decode(
        self, batch_size: int, context_tokens: int, suffix_tokens: int, seconds: float
    ) -> None:
        kind = "decode" if suffix_tokens == 0 else "mixed"
        self.rt.metrics.step.labels(self.rt.cfg.worker_id, kind).observe(seconds)
        if suffix_tokens == 0 and batch_size > 0:
            self._error(
                "decode", self.profile.decode_iter_time_s(batch_size, context_tokens), seconds
            )
            self.recal.observe_decode(batch_size, context_tokens, seconds)

    def _error(self, predictor: str, predicted: float, measured: float) -> None:
        if measured > 0:
            self.rt.metrics.predictor_error.labels(self.rt.cfg.worker_id, predictor).set(
                abs(predicted - measured) / measured
            )

    # ----------------------------------------------------------------- outbound
    def _decode_load(self) -> DecodeLoad:
        dec = self.rt.decode
        bm = self.rt.engine.block_manager
        capacity = bm.num_usable_blocks * bm.block_size
        # C_reserved = held − active (shared with the simulator: decode_load_from_pool), plus
        # the requests our prefill peers keep waiting for our capacity.
        waiting = dec.waiting.totals(time.monotonic())
        return decode_load_from_pool(
            capacity,
            capacity - bm.num_free_blocks * bm.block_size,
            sum(r.seq.num_tokens for r in dec.runnable),
            len(dec.runnable),
            len(dec.requests),
            dec.max_num_seqs,
            waiting_kv_tokens=waiting.kv_tokens,
            waiting_requests=waiting.requests,
        )

    def _refresh_decode(self) -> None:
        now = time.monotonic()
        peers = [p for p, seen in self.prefill_peers.items() if now - seen < _PEER_FRESH_S]
        pressure = decode_pressure(
            self._decode_load(),
            self.profile,
            self.policy,
            max(1, len(peers)),
            max_batch=self.rt.cfg.max_num_seqs,
        )
        self.dpi_load = pressure.dpi_load
        self.dpi_adm = pressure.dpi_adm
        # Suffix work already accepted and not yet run uses up the same TPOT slack: the
        # budget we offer (and re-check) is what is left of one iteration's worth (eq. 16-17).
        pending = self.rt.decode.pending_prompt_tokens()
        budget = offered_budget_tokens(pressure.steal_budget_tokens, pending)
        self.steal_budget_tokens = budget if self.rt.role == "decode" else 0.0
        self.max_suffix_tokens = pressure.max_suffix_tokens
        self.tpot_slack_s = pressure.tpot_slack_s

    def _refresh_prefill(self) -> None:
        pf = self.rt.prefill
        jobs = list(pf.queue)
        running_s = 0.0
        if pf.current is not None:
            running_s = self.profile.prefill_time_s(pf.current.prompt_len)
        # What a newcomer would wait for (the router predicts TTFT from it): the queue plus
        # what remains of the running prefill.
        remaining_s = running_s
        started = pf.current.timestamps.get("prefill_start_s") if pf.current else None
        if started is not None:
            remaining_s = max(0.0, running_s - (time.time() - started))
        self.queue_work_s = queue_work_s(
            (j.prompt_len for j in jobs), self.profile, running_remaining_s=remaining_s
        )
        self.ppi = queue_ppi(
            self._queue_view(jobs),
            self.profile,
            self.policy,
            time.monotonic(),
            running_remaining_s=running_s,
        )

    def snapshot(self) -> WorkerTelemetry:
        rt = self.rt
        if rt.cfg.recalibrate:
            self.profile = self.recal.profile()
        self._refresh_decode()
        self._refresh_prefill()
        now = time.monotonic()
        budgets: dict[str, int] = {}
        if rt.role == "decode":
            budgets = {
                p: int(self.steal_budget_tokens)
                for p, seen in self.prefill_peers.items()
                if now - seen < _PEER_FRESH_S
            }
        bm = rt.engine.block_manager
        dec, pf = rt.decode, rt.prefill
        waiting = dec.waiting.totals(now)
        return WorkerTelemetry(
            publisher_id=rt.cfg.worker_id,
            epoch=rt.sequencer.epoch,
            seq=rt.sequencer.next_seq("telemetry"),
            time_s=time.time(),
            role=rt.role,
            state=rt.state,
            queue_len=pf.queue_len,
            running=dec.num_running,
            free_blocks=bm.num_free_blocks,
            total_blocks=bm.num_usable_blocks,
            ppi=self.ppi,
            dpi_load=self.dpi_load,
            dpi_adm=self.dpi_adm,
            steal_budgets=budgets,
            stolen_tokens_total=dec.stolen_tokens_total + pf.handed_off_tokens_total,
            metrics={
                "decode_stolen_tokens_total": float(dec.stolen_tokens_total),
                "prefill_handed_off_tokens_total": float(pf.handed_off_tokens_total),
                "split_requests_total": float(pf.split_requests_total),
                "refused_steals_total": float(dec.refused_steals_total),
                "migrations_in_total": float(dec.migrations_in_total),
                "migrations_out_total": float(dec.migrations_out_total),
                "switches_total": float(rt.switcher.switches_total),
                # The last completed switch's phases (0 before the first): benchmarks read them.
                **{
                    f"switch_{k}": float(rt.switcher.last_durations_ms.get(k, 0.0))
                    for k in ("drain_ms", "reslice_ms", "route_update_ms")
                },
                "running_prefill_tokens": float(pf.current.prompt_len if pf.current else 0),
                "reserved_blocks": float(bm.num_reserved_blocks),
                "receiving": float(dec.num_receiving),
                "decode_iterations_total": float(dec.iterations_total),
                "prefills_total": float(pf.prefills_total),
                # Overload (docs/operations.md): queued prefill work in predicted seconds and
                # T_pre's coefficients (the router predicts TTFT from them), requests waiting
                # for decode capacity on either side, and what was dropped or timed out.
                "queue_work_s": self.queue_work_s,
                "prefill_c0_s": self.profile.prefill_c0_s,
                "prefill_c1_s_per_token": self.profile.prefill_c1_s_per_token,
                "admission_waiting": float(len(pf.admission.waiting)),
                "decode_waiting": float(waiting.requests),
                "decode_waiting_blocks": float(-(-waiting.kv_tokens // bm.block_size)),
                "expired_total": float(pf.expired_total),
                "decode_wait_timeouts_total": float(pf.admission.wait_timeouts_total),
                "repaired_for_capacity_total": float(pf.admission.repaired_for_capacity_total),
                "pid": float(__import__("os").getpid()),
            },
        )

    async def _publish_loop(self) -> None:
        rt = self.rt
        interval = rt.cfg.telemetry_interval_s
        while True:
            try:
                msg = self.snapshot()  # (Prometheus gauges are refreshed on scrape)
                await rt.bus.publish(rt.subjects.telemetry(rt.role, rt.cfg.worker_id), msg)
            except Exception:
                log.exception("telemetry_publish_failed", worker_id=rt.cfg.worker_id)
            await asyncio.sleep(interval)  # a period, not a synchronisation

    def describe(self) -> dict[str, Any]:
        return {"ppi": self.ppi, "dpi_load": self.dpi_load, "dpi_adm": self.dpi_adm}
