"""Worker telemetry out: every ~20 ms one ``WorkerTelemetry`` message with this worker's
pressure signals (the policy's, services/worker/policy.py), its pool and its roles' counters.

The subscribe half (peers' telemetry in) is services/worker/peers.py. Nothing here decides
anything: it reads the roles' ``stats()`` snapshots, refreshes the policy from them and
publishes.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

import structlog

from services.worker.peers import Peers
from services.worker.policy import WorkerPolicy
from services.worker.stats import DecodeStats, PrefillStats, SwitchStats
from services.worker.status import WorkerStatus
from shared.aio import cancel_and_wait
from shared.bus import Bus
from shared.messages import StreamSequencer, Subjects, WorkerTelemetry
from shared.policy.busy import BusyMeter
from shared.policy.roles import DECODE

log = structlog.get_logger(__name__)


class Telemetry:
    """The publish loop (``start``/``stop``, idempotent stop)."""

    def __init__(
        self,
        worker_id: str,
        bus: Bus,
        subjects: Subjects,
        sequencer: StreamSequencer,
        status: WorkerStatus,
        policy: WorkerPolicy,
        peers: Peers,
        *,
        decode_stats: Callable[[], DecodeStats],
        prefill_stats: Callable[[], PrefillStats],
        switch_stats: Callable[[], SwitchStats],
        interval_s: float,
    ) -> None:
        self.worker_id = worker_id
        self._bus = bus
        self._subjects = subjects
        self._sequencer = sequencer
        self._status = status
        self._policy = policy
        self._peers = peers
        self._decode_stats = decode_stats
        self._prefill_stats = prefill_stats
        self._switch_stats = switch_stats
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        # Prefill busy fraction over FluidRole's window (the controller reads it, P->D bound).
        self._busy = BusyMeter(policy.policy.window_s)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._publish_loop())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None

    def snapshot(self) -> WorkerTelemetry:
        """Refresh the policy's signals from the roles' snapshots; the message to publish."""
        dec, pf, sw = self._decode_stats(), self._prefill_stats(), self._switch_stats()
        policy = self._policy
        policy.refresh(dec, pf)
        sig = policy.signals()
        now = time.monotonic()
        status = self._status
        budgets: dict[str, int] = {}
        if status.role == DECODE:
            self._busy.clear()  # back in prefill, the fraction restarts from its own samples
            offer = int(sig.steal_budget_tokens)
            budgets = {p: offer for p in self._peers.fresh_prefill_peers(now)}
        else:
            self._busy.sample(now, pf.busy_s_total)
        pool = dec.pool
        return WorkerTelemetry(
            publisher_id=self.worker_id,
            epoch=self._sequencer.epoch,
            seq=self._sequencer.next_seq("telemetry"),
            time_s=time.time(),
            role=status.role,
            state=status.state,
            queue_len=pf.queue_len,
            running=dec.num_running,
            free_blocks=pool.free_blocks,
            total_blocks=pool.usable_blocks,
            ppi=sig.ppi,
            dpi_load=sig.dpi_load,
            dpi_adm=sig.dpi_adm,
            steal_budgets=budgets,
            stolen_tokens_total=dec.stolen_tokens_total + pf.handed_off_tokens_total,
            metrics={
                "decode_stolen_tokens_total": float(dec.stolen_tokens_total),
                "prefill_handed_off_tokens_total": float(pf.handed_off_tokens_total),
                "split_requests_total": float(pf.split_requests_total),
                "refused_steals_total": float(dec.refused_steals_total),
                "migrations_in_total": float(dec.migrations_in_total),
                "migrations_in_failed_total": float(dec.migrations_in_failed_total),
                "migrations_out_total": float(dec.migrations_out_total),
                "switches_total": float(sw.switches_total),
                # The last completed switch's phases (0 before the first): benchmarks read them.
                **{
                    f"switch_{k}": float(sw.last_durations_ms.get(k, 0.0))
                    for k in ("drain_ms", "reslice_ms", "route_update_ms")
                },
                "running_prefill_tokens": float(pf.running_prompt_tokens),
                "reserved_blocks": float(pool.reserved_blocks),
                "receiving": float(dec.num_receiving),
                "decode_iterations_total": float(dec.iterations_total),
                # FluidRole's decode flow forecast (shared/policy/decode_flow.py).
                "decode_entered_total": float(dec.entered_total),
                "decode_left_total": float(dec.left_total),
                "prefills_total": float(pf.prefills_total),
                "prefill_busy_frac": self._busy.fraction(),
                # Overload (docs/operations.md): queued prefill work in predicted seconds and
                # T_pre's coefficients (the router predicts TTFT from them), requests waiting
                # for decode capacity on either side, and what was dropped or timed out.
                "queue_work_s": sig.queue_work_s,
                "prefill_c0_s": policy.profile.prefill_c0_s,
                "prefill_c1_s_per_token": policy.profile.prefill_c1_s_per_token,
                "admission_waiting": float(pf.admission_waiting),
                "decode_waiting": float(dec.waiting_requests),
                "decode_waiting_blocks": float(-(-dec.waiting_kv_tokens // pool.block_size)),
                "expired_total": float(pf.expired_total),
                "decode_wait_timeouts_total": float(pf.decode_wait_timeouts_total),
                "repaired_for_capacity_total": float(pf.repaired_for_capacity_total),
                "pid": float(os.getpid()),
            },
        )

    async def _publish_loop(self) -> None:
        while True:
            try:
                msg = self.snapshot()  # (Prometheus gauges are refreshed on scrape)
                subject = self._subjects.telemetry(self._status.role, self.worker_id)
                await self._bus.publish(subject, msg)
            except Exception:
                log.exception("telemetry_publish_failed", worker_id=self.worker_id)
            await asyncio.sleep(self.interval_s)  # a period, not a synchronisation
