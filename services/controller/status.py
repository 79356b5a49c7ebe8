"""What the controller knows about each worker: latest telemetry, PPI window, registry record.

Pure bookkeeping (no I/O): the controller feeds it telemetry and registry records and asks
for status rows (``fluidpd ctl status``) and the policy's ClusterSnapshot. Times are this
process's monotonic clock, so a worker's clock never makes its telemetry look fresh.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shared.messages import WorkerRecord, WorkerRow, WorkerTelemetry
from shared.policy.decode_flow import FlowCounters
from shared.policy.fluidrole import ClusterSnapshot, WorkerView
from shared.policy.roles import ACTIVE, DECODE, DRAIN, PREFILL, SWITCH
from shared.policy.window import KeyedWindows

# Worker-reported state → policy state. States not listed ("starting", "stopping") keep a
# worker out of the policy snapshot: it neither serves nor is switching.
_POLICY_STATE = {
    ACTIVE: ACTIVE,
    DRAIN: DRAIN,
    "draining": DRAIN,  # older spellings, still accepted from the wire
    SWITCH: SWITCH,
    "switching": SWITCH,
}


@dataclass(frozen=True, slots=True)
class _Seen:
    msg: WorkerTelemetry
    received_s: float  # controller monotonic clock


class WorkerBook:
    """Latest telemetry per worker plus a PPI window per prefill worker. Mutable."""

    def __init__(self, window_s: float, stale_s: float) -> None:
        self.stale_s = stale_s
        self._latest: dict[str, _Seen] = {}
        self._ppi = KeyedWindows(window_s)

    def observe(self, msg: WorkerTelemetry, now_s: float) -> None:
        """Record one telemetry message received at ``now_s``. Mutates the book."""
        self._latest[msg.publisher_id] = _Seen(msg, now_s)
        if msg.role == PREFILL:
            self._ppi.add(msg.publisher_id, now_s, msg.ppi)
        else:
            self._ppi.forget(msg.publisher_id)  # a switched worker starts a fresh window

    def forget(self, worker_id: str) -> None:
        """Drop a worker that left the registry. Mutates the book."""
        self._latest.pop(worker_id, None)
        self._ppi.forget(worker_id)

    def fresh(self, worker_id: str, now_s: float) -> WorkerTelemetry | None:
        seen = self._latest.get(worker_id)
        if seen is None or now_s - seen.received_s > self.stale_s:
            return None
        return seen.msg

    def last_seen_s(self, worker_id: str, now_s: float) -> float:
        """Seconds since the worker's last telemetry (-1 when never heard)."""
        seen = self._latest.get(worker_id)
        return -1.0 if seen is None else max(0.0, now_s - seen.received_s)

    def rows(self, records: Iterable[WorkerRecord], now_s: float) -> list[WorkerRow]:
        """One status row per live (registered) worker, sorted by id. Pure."""
        rows = []
        for rec in sorted(records, key=lambda r: r.worker_id):
            tel = self.fresh(rec.worker_id, now_s)
            rows.append(
                WorkerRow(
                    worker_id=rec.worker_id,
                    role=tel.role if tel else rec.role,
                    state=tel.state if tel else rec.state,
                    free_blocks=tel.free_blocks if tel else 0,
                    total_blocks=tel.total_blocks if tel else rec.kv_total_blocks,
                    ppi=tel.ppi if tel else 0.0,
                    dpi_load=tel.dpi_load if tel else 0.0,
                    dpi_adm=tel.dpi_adm if tel else 0.0,
                    stolen_tokens=tel.stolen_tokens_total if tel else 0,
                    pid=int(tel.metrics.get("pid", rec.pid)) if tel else rec.pid,
                    last_seen_s=round(self.last_seen_s(rec.worker_id, now_s), 3),
                )
            )
        return rows

    def snapshot(self, records: Iterable[WorkerRecord], now_s: float) -> ClusterSnapshot:
        """The policy's view: registered workers in a policy state, with fresh signals. Pure
        apart from pruning old PPI samples."""
        views = []
        for rec in sorted(records, key=lambda r: r.worker_id):
            tel = self.fresh(rec.worker_id, now_s)
            state = _POLICY_STATE.get(tel.state if tel else rec.state)
            if state is None:
                continue
            role = tel.role if tel else rec.role
            if tel is None:
                views.append(WorkerView(rec.worker_id, role, state))
                continue
            used_blocks = max(0, tel.total_blocks - tel.free_blocks)
            views.append(
                WorkerView(
                    worker_id=rec.worker_id,
                    role=role,
                    state=state,
                    ppi_p95=(self._ppi.p95(rec.worker_id, now_s) or 0.0)
                    if role == PREFILL
                    else 0.0,
                    ppi_now=tel.ppi if role == PREFILL else 0.0,
                    dpi_load=tel.dpi_load,
                    dpi_adm=tel.dpi_adm,
                    active_decode_requests=tel.running,
                    kv_active_tokens=used_blocks * rec.kv_block_size,
                    running_prefill_tokens=int(tel.metrics.get("running_prefill_tokens", 0.0)),
                    prefill_busy_frac=tel.metrics.get("prefill_busy_frac", 0.0)
                    if role == PREFILL
                    else 0.0,
                    queue_len=tel.queue_len,
                    # FluidRole's decode backlog (fluidrole.decode_demand): requests this
                    # decode worker refused for capacity and its batch limit.
                    decode_waiting=int(tel.metrics.get("decode_waiting", 0.0))
                    if role == DECODE
                    else 0,
                    max_decode_requests=rec.max_num_seqs if role == DECODE else 0,
                    # FluidRole's decode flow (decode_flow.py), in any role.
                    decode_counters=FlowCounters(
                        tel.metrics.get("decode_entered_total", 0.0),
                        tel.metrics.get("decode_left_total", 0.0),
                    ),
                )
            )
        return ClusterSnapshot(tuple(views))
