"""Router custody (services/router/in_flight.py, dispatch.py): a request's tokens are taken
only from the workers it was given to or explicitly handed to. An Active decode worker the
router was never told of is dropped and counted as foreign, even while the request's own
decode worker is no longer Active (the D->P drain a live migration happens in); the
migration's hand-over item is what lets its peer stream. Until the peer streams, the
worker the migration comes from still holds the request (its removal ends the stream).
Pure: no bus traffic."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from services.router.config import RouterConfig
from services.router.dispatch import Dispatcher
from services.router.in_flight import InFlight
from services.router.metrics import RouterMetrics
from services.router.pairing import RoundRobinPolicy
from services.router.streams import RequestStream
from shared.bus import Bus, BusConfig
from shared.bus.registry_watcher import RegistryChange
from shared.messages import Role, Subjects, TokenBatch, TokenItem, WorkerRecord
from shared.policy.roles import DECODE, PREFILL
from tests.support.worker_messages import worker_record

# What the registry shows: p1 prefill, d2 an Active decode worker; d1, the request's decode
# worker, is draining (a D->P switch), so it is not among the Active decode workers.
ACTIVE: dict[Role, list[WorkerRecord]] = {
    PREFILL: [worker_record("p1", PREFILL)],
    DECODE: [worker_record("d2", DECODE)],
}


def dispatcher() -> tuple[Dispatcher, InFlight]:
    subjects = Subjects()
    cfg = RouterConfig(port=0, model="tiny")
    bus = Bus(BusConfig(), subjects)  # never started: on_tokens sends nothing
    metrics = RouterMetrics.create(CollectorRegistry(), "tiny")
    d = Dispatcher(cfg, bus, subjects, lambda role: ACTIVE[role], RoundRobinPolicy(), metrics)
    entry = InFlight("r1", "p1", "d1", RequestStream("r1"), 0.0, 4, 8)
    d.in_flight["r1"] = entry
    return d, entry


def batch(publisher_id: str, seq: int, *items: TokenItem) -> TokenBatch:
    return TokenBatch(publisher_id=publisher_id, epoch=1, seq=seq, items=items)


def token(index: int) -> TokenItem:
    return TokenItem(request_id="r1", index=index, token_ids=(100 + index,))


def handed(to_id: str) -> TokenItem:
    return TokenItem(request_id="r1", handed_to=to_id, handed_role=DECODE)


def foreign_items(d: Dispatcher) -> float:
    return float(d.metrics.foreign_token_items_total._value.get())


async def test_an_active_decode_worker_without_custody_is_dropped() -> None:
    d, entry = dispatcher()
    await d.on_tokens(batch("p1", 0, token(0)))  # P's first token
    assert entry.stream.num_tokens == 1
    await d.on_tokens(batch("d2", 0, token(1), token(2)))
    assert entry.stream.num_tokens == 1  # dropped, not taken as a migration target
    assert foreign_items(d) == 2
    assert entry.decode_id == "d1" and entry.custody == {"p1", "d1"}  # nothing rebound


async def test_a_hand_over_lets_the_new_decode_worker_stream() -> None:
    d, entry = dispatcher()
    await d.on_tokens(batch("p1", 0, token(0)))
    await d.on_tokens(batch("d1", 0, token(1)))
    # d1 live-migrates the request to d2: the notice comes first on d1's stream.
    await d.on_tokens(
        batch("d1", 1, TokenItem(request_id="r1", handed_to="d2", handed_role=DECODE))
    )
    assert entry.decode_id == "d2" and "d2" in entry.custody
    await d.on_tokens(batch("d2", 0, token(2), token(3)))
    assert entry.stream.num_tokens == 4 and foreign_items(d) == 0
    # A worker nobody handed it to still cannot, Active decode worker or not.
    await d.on_tokens(batch("d3", 0, token(4)))
    assert entry.stream.num_tokens == 4 and foreign_items(d) == 1


def removed(worker_id: str) -> RegistryChange:
    record = worker_record(worker_id, DECODE)
    return RegistryChange("removed", worker_id, record, reason="heartbeat_timeout")


async def test_the_source_of_a_pending_migration_still_holds_the_request() -> None:
    # d1 hands the request to d2 (a live migration) and dies before the KV arrived: d2's
    # receive fails silently (the source owns the move's outcome), so only d1's removal
    # can end the stream; no longer once d2 streams it.
    d, entry = dispatcher()
    await d.on_tokens(batch("p1", 0, token(0)))
    await d.on_tokens(batch("d1", 0, token(1), handed("d2")))
    assert entry.decode_id == "d2" and entry.moving_from == "d1"
    d.on_registry_change(removed("d1"))
    assert entry.stream.finished
    chunk = await entry.stream.next()  # the two tokens, then the end
    assert chunk.end is not None or (chunk := await entry.stream.next()).end is not None
    assert chunk.end.error_code == "worker_lost", chunk.end
    await asyncio.gather(*d._tasks)  # the cancel (to the bus, never started)
    assert entry.cancelled

    d, entry = dispatcher()
    await d.on_tokens(batch("p1", 0, token(0)))
    await d.on_tokens(batch("d1", 0, token(1), handed("d2")))
    await d.on_tokens(batch("d2", 0, token(2)))  # the move landed
    assert entry.moving_from == ""
    d.on_registry_change(removed("d1"))
    assert not entry.stream.finished and entry.stream.num_tokens == 3


async def test_a_move_that_fails_over_to_another_peer_or_back_keeps_the_source_right() -> None:
    d, entry = dispatcher()
    await d.on_tokens(batch("p1", 0, token(0)))
    # d1 -> d2 fails (d2 says nothing), d1 moves it on to d3: d1 still the source.
    await d.on_tokens(batch("d1", 0, token(1), handed("d2"), handed("d3")))
    assert entry.decode_id == "d3" and entry.moving_from == "d1"
    # d3 fails too: d1 takes it back and resumes it; d2's or d3's removal is harmless.
    await d.on_tokens(batch("d1", 1, handed("d1")))
    assert entry.decode_id == "d1" and entry.moving_from == ""
    d.on_registry_change(removed("d2"))
    d.on_registry_change(removed("d3"))
    await d.on_tokens(batch("d1", 2, token(2)))
    assert not entry.stream.finished and entry.stream.num_tokens == 3
    # A re-pairing by the prefill worker is no live migration.
    d, entry = dispatcher()
    await d.on_tokens(batch("p1", 0, handed("d2")))
    assert entry.decode_id == "d2" and entry.moving_from == ""
