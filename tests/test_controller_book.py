"""The controller's WorkerBook hands FluidRole the decode backlog it bounds moves with: a
decode worker's ``decode_waiting`` telemetry and its registry batch limit (max_num_seqs),
on decode views only. Pure bookkeeping, no processes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.controller.status import WorkerBook
from shared.messages import Role, WorkerRecord, WorkerTelemetry
from shared.policy.config import PolicyConfig
from shared.policy.decode_flow import FlowCounters
from shared.policy.fluidrole import RolePolicy, decode_demand
from shared.policy.fluidrole_sizing import DecodeDemand
from tests.support.worker_messages import worker_record, worker_telemetry


def record(worker_id: str, role: Role, max_num_seqs: int) -> WorkerRecord:
    return worker_record(worker_id, role, decode_reserve_tokens=32, max_num_seqs=max_num_seqs)


def telemetry(worker_id: str, role: Role, running: int, waiting: float) -> WorkerTelemetry:
    return worker_telemetry(
        worker_id,
        role,
        queue_len=3 if role == "prefill" else 0,
        running=running,
        free_blocks=100,
        ppi=0.5,
        dpi_load=0.2,
        dpi_adm=0.3,
        metrics={"decode_waiting": waiting},
    )


def test_snapshot_carries_decode_waiting_and_batch_limit() -> None:
    book = WorkerBook(window_s=5.0, stale_s=1.0)
    book.observe(telemetry("d0", "decode", running=10, waiting=4.0), 0.0)
    book.observe(telemetry("d1", "decode", running=7, waiting=0.0), 0.0)
    # A prefill worker's telemetry may carry the key too; it is not decode backlog.
    book.observe(telemetry("p0", "prefill", running=1, waiting=9.0), 0.0)
    records = [record("d0", "decode", 48), record("d1", "decode", 48), record("p0", "prefill", 8)]
    views = {v.worker_id: v for v in book.snapshot(records, 0.5).workers}
    assert (views["d0"].decode_waiting, views["d0"].max_decode_requests) == (4, 48)
    assert (views["d1"].decode_waiting, views["d1"].max_decode_requests) == (0, 48)
    assert (views["p0"].decode_waiting, views["p0"].max_decode_requests) == (0, 0)
    # What the policy bounds a D→P move by: running + waiting on decode workers.
    assert decode_demand(tuple(views.values())) == DecodeDemand(10 + 4 + 7, 48)


def test_snapshot_carries_the_decode_flow_from_the_workers_counters() -> None:
    # The book puts each worker's counters on its view; the policy's meter sums them.
    book = WorkerBook(window_s=5.0, stale_s=1.0)
    policy = RolePolicy(PolicyConfig(decode_flow_window_s=10.0))
    records = [record("d0", "decode", 48), record("d1", "decode", 48)]

    def tick(t: float, counts: dict[str, tuple[float, float]], running: int) -> None:
        for wid, (entered, left) in counts.items():
            msg = worker_telemetry(
                wid,
                "decode",
                running=running,
                metrics={"decode_entered_total": entered, "decode_left_total": left},
            )
            book.observe(msg, t)

    tick(0.0, {"d0": (100.0, 90.0), "d1": (0.0, 0.0)}, running=5)
    snap = book.snapshot(records, 0.1)
    assert {v.worker_id: v.decode_counters for v in snap.workers} == {
        "d0": FlowCounters(100.0, 90.0),
        "d1": FlowCounters(0.0, 0.0),
    }
    first = policy.decide(snap, 0.1).decode_flow
    assert first is not None and (first.entered, first.left, first.mean_backlog) == (0, 0, 10)
    tick(1.0, {"d0": (130.0, 100.0), "d1": (20.0, 10.0)}, running=15)
    flow = policy.decide(book.snapshot(records, 1.1), 1.1).decode_flow
    assert flow is not None and (flow.entered, flow.left, flow.mean_backlog) == (50, 20, 20)
    assert flow.requests == pytest.approx(20 * 50 / 20)
    # Off (window 0): no flow in the decision.
    off = RolePolicy(PolicyConfig(decode_flow_window_s=0.0))
    assert off.decide(book.snapshot(records, 1.2), 1.2).decode_flow is None


def test_snapshot_carries_a_prefill_workers_latest_ppi_beside_its_window() -> None:
    book = WorkerBook(window_s=5.0, stale_s=2.0)
    for t, ppi in ((0.0, 1.4), (1.0, 1.2), (2.0, 0.05)):  # the queue drains
        book.observe(replace(telemetry("p0", "prefill", running=1, waiting=0.0), ppi=ppi), t)
    book.observe(telemetry("d0", "decode", running=3, waiting=0.0), 2.0)
    records = [record("p0", "prefill", 8), record("d0", "decode", 48)]
    views = {v.worker_id: v for v in book.snapshot(records, 2.5).workers}
    assert views["p0"].ppi_now == 0.05 and views["p0"].ppi_p95 == 1.4  # eq. 20 still holds 1.4
    assert views["d0"].ppi_now == 0.0
