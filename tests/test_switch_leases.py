"""The controller's switch-lease rules (services/controller/leases.py), pure."""

from __future__ import annotations

from services.controller.leases import SwitchLeases
from shared.messages import WorkerRecord
from tests.support.worker_messages import worker_record


def _rec(worker_id: str, role: str, state: str = "active") -> WorkerRecord:
    return worker_record(
        worker_id,
        role,  # type: ignore[arg-type]
        state=state,
        model="tiny",
        kv_total_blocks=8,
        max_model_len=64,
    )


def test_never_the_last_worker_whatever_the_interleaving() -> None:
    book = SwitchLeases(ttl_s=10)
    view = [_rec("p0", "prefill"), _rec("p1", "prefill"), _rec("d0", "decode")]
    assert book.acquire("p0", "prefill", "decode", view, 0.0) is None
    # p0's switch is in flight: p1 is the last prefill worker that stays.
    assert book.acquire("p1", "prefill", "decode", view, 0.0) == (
        "switch would leave no active prefill worker"
    )
    assert book.acquire("p0", "prefill", "decode", view, 0.0) is not None  # already switching
    assert book.acquire("d0", "decode", "prefill", view, 0.0) == (
        "switch would leave no active decode worker"
    )
    assert book.in_flight() == {"p0": "prefill"}


def test_a_sized_move_switches_several_workers_of_a_role_together() -> None:
    book = SwitchLeases(ttl_s=10)
    view = [_rec(f"p{i}", "prefill") for i in range(3)] + [_rec("d0", "decode")]
    assert book.acquire("p0", "prefill", "decode", view, 0.0) is None
    assert book.acquire("p1", "prefill", "decode", view, 0.0) is None  # k = 2 at once
    assert book.acquire("p2", "prefill", "decode", view, 0.0) is not None  # the last one
    assert book.in_flight() == {"p0": "prefill", "p1": "prefill"}


def test_a_released_switch_counts_before_the_registry_shows_it() -> None:
    book = SwitchLeases(ttl_s=10)
    view = [_rec("p0", "prefill"), _rec("p1", "prefill"), _rec("d0", "decode")]
    assert book.acquire("p0", "prefill", "decode", view, 0.0) is None
    book.release("p0", "decode", 1.0)
    # The registry view is stale (p0 still "prefill"): p1 is the last prefill worker.
    refusal = book.acquire("p1", "prefill", "decode", view, 1.1)
    assert refusal == "switch would leave no active prefill worker"
    # Once the registry shows p0 as decode, the override is dropped; still refused.
    view = [_rec("p0", "decode"), _rec("p1", "prefill"), _rec("d0", "decode")]
    assert book.acquire("p1", "prefill", "decode", view, 1.2) is not None
    assert book.acquire("p0", "decode", "prefill", view, 1.3) is None


def test_leases_expire_and_are_dropped_with_their_worker() -> None:
    book = SwitchLeases(ttl_s=10)
    view = [_rec("p0", "prefill"), _rec("p1", "prefill"), _rec("p2", "prefill")]
    assert book.acquire("p0", "prefill", "decode", view, 0.0) is None
    assert book.acquire("p1", "prefill", "decode", view, 5.0) is None
    assert book.acquire("p2", "prefill", "decode", view, 5.0) is not None  # p2 is the last
    assert book.acquire("p2", "prefill", "decode", view, 10.5) is None  # p0's expired
    book.forget("p1")
    book.forget("p2")
    assert book.in_flight() == {}
    # A draining worker is not Active: it does not count as staying.
    view = [_rec("p0", "prefill", "drain"), _rec("p1", "prefill")]
    assert book.acquire("p1", "prefill", "decode", view, 11.0) is not None
