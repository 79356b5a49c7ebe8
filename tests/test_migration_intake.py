"""A decode worker's intake when a KV receive fails, in-process: the emulated tiny engine
and a real UCX receiver (services/worker/decode/decode_intake.py). In the first two cases
nothing ever sends, so each receive ends at its deadline, through the receiver's real
failure path.

* An incoming live migration: the source owns the move's outcome (it resumes the request
  or moves it on), so the peer ends it without an item on the request's stream; its
  reservation is freed and nothing is left in its table or block manager.
* A plain admit from a prefill worker: the error item still ends the stream (the prefill
  worker does not retry a failed export).

* A cancel that overtakes the migration: refused when the peer was told first; when only
  the source was told (while it asked the peer), the source moves nothing and has the
  peer drop its reservation (a source in this process beside the peer, sharing its node).
* A move whose "installed" verdict is lost: the source cannot know whether the peer runs
  it, so it ends the stream (``migration_failed``) and has the peer drop its copy.

The same fault on real processes, through the router: test_fail_migration.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import pytest_asyncio

from services.worker.config import WorkerConfig
from services.worker.decode.decode_role import DecodeRole
from services.worker.engine_factory import build_engine, fingerprint_of
from services.worker.role_switch.migration import Migrator
from services.worker.token_stream import TokenStreamer
from services.worker.transfer_endpoints import TransferEndpoints, open_transfer
from shared.bus import Bus, BusConfig
from shared.engine.interface import StepEngine
from shared.messages import (
    AdmitReply,
    AdmitRequest,
    CancelRequest,
    MigrateRequest,
    PrefillRequest,
    SamplingParams,
    StreamSequencer,
    Subjects,
    TokenBatch,
    TokenItem,
)
from shared.policy.roles import DECODE
from shared.transfer.receiver import KVReceiver
from shared.transfer.sender import KVSender
from shared.transfer.ucx_node import TransferNode
from tests.support.nats_server import NatsServer

pytestmark = pytest.mark.asyncio(loop_scope="module")

TRANSFER_TIMEOUT_S = 0.5
# d0 moves r1 (40 prompt tokens, 5 generated) here.
MIGRATION = MigrateRequest(
    request_id="r1",
    router_id="migrated",
    tokens_subject="tokens.rt",
    source_worker_id="d0",
    prompt_len=40,
    num_tokens=45,
    generated_token_ids=(7, 8, 9, 10, 11),
    sampling=SamplingParams(max_tokens=50, seed=3),
    rng_offset=5,
)


def _config(worker_id: str) -> WorkerConfig:
    return WorkerConfig(
        worker_id=worker_id,
        role=DECODE,
        engine="emulated",
        num_kv_blocks=32,
        cluster_secret="s" * 32,
    )


def _role(engine: StepEngine, receiver: KVReceiver, streamer: TokenStreamer) -> DecodeRole:
    return DecodeRole(
        engine,
        receiver,
        streamer,
        ThreadPoolExecutor(1),  # no step runs here: never used
        lambda: None,
        transfer_timeout_s=TRANSFER_TIMEOUT_S,
        max_num_seqs=8,
    )


@pytest_asyncio.fixture(loop_scope="module", scope="module")  # UCX: one node per process
async def endpoints() -> AsyncIterator[tuple[StepEngine, TransferEndpoints]]:
    engine = build_engine(_config("d1"))
    async with contextlib.AsyncExitStack() as stack:
        yield engine, await open_transfer(_config("d1"), engine, stack)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def peer(
    endpoints: tuple[StepEngine, TransferEndpoints],
) -> AsyncIterator[tuple[DecodeRole, TokenStreamer]]:
    engine, transfer = endpoints
    streamer = TokenStreamer(StreamSequencer("d1"))
    yield _role(engine, transfer.receiver, streamer), streamer


def _items(streamer: TokenStreamer) -> list[TokenItem]:
    return [i for _, b in streamer.take() if isinstance(b, TokenBatch) for i in b.items]


async def _receive_ended(role: DecodeRole, request_id: str) -> None:
    task = role.table.requests[request_id].receive_task
    assert task is not None
    await asyncio.wait_for(task, TRANSFER_TIMEOUT_S + 5.0)


def _source(
    node: TransferNode, request_id: str
) -> tuple[StepEngine, KVReceiver, DecodeRole, TokenStreamer]:
    """Decode worker d0 in this process beside d1 (on d1's UCX node), running
    ``request_id`` as if its prompt ran and one token came out."""
    cfg0 = _config("d0")
    engine0 = build_engine(cfg0)
    receiver0 = KVReceiver(
        node,
        worker_id="d0",
        block_manager=engine0.block_manager,
        arena=engine0.arena,
        fingerprint=fingerprint_of(engine0),
        secret=cfg0.secret_bytes,
    )
    streamer0 = TokenStreamer(StreamSequencer("d0"))
    role0 = _role(engine0, receiver0, streamer0)
    role0.serve_local(
        PrefillRequest(
            request_id=request_id,
            router_id="rt",
            prompt_token_ids=tuple(range(4, 44)),
            sampling=SamplingParams(max_tokens=50, seed=3),
            decode_worker_id="d0",
            arrival_time_s=0.0,
            ttft_deadline_s=10.0,
            tokens_subject="tokens.rt",
        )
    )
    seq = role0.table.requests[request_id].seq
    seq.num_cached_tokens, seq.output_token_ids = 40, [7]
    return engine0, receiver0, role0, streamer0


def _migrator(
    bus: Bus,
    subjects: Subjects,
    node: TransferNode,
    engine0: StepEngine,
    role0: DecodeRole,
    transfer_timeout_s: float,
) -> tuple[Migrator, KVSender]:
    """d0's migrator and the KV sender it moves with (the caller closes the sender)."""
    secret = _config("d0").secret_bytes
    sender0 = KVSender(node, worker_id="d0", fingerprint=fingerprint_of(engine0), secret=secret)
    migrator = Migrator(
        "d0",
        bus,
        subjects,
        engine0,
        sender0,
        role0.table,
        secret=secret,
        transfer_timeout_s=transfer_timeout_s,
        deliver_now=_no_flush,
    )
    return migrator, sender0


async def test_a_failed_migration_in_ends_without_an_item_and_frees_everything(
    peer: tuple[DecodeRole, TokenStreamer],
) -> None:
    role, streamer = peer
    bm = role.bm
    failed_before = role.stats().migrations_in_failed_total
    reply = role.admit_migration(MIGRATION)
    assert reply.ok, reply
    assert bm.num_reserved_blocks > 0  # the ticket's blocks
    await _receive_ended(role, "r1")
    assert _items(streamer) == []  # nothing on the request's stream: the source decides
    assert role.table.drained()
    assert role.stats().migrations_in_failed_total == failed_before + 1
    assert bm.num_reserved_blocks == 0 and bm.num_free_blocks == bm.num_usable_blocks
    bm.check_integrity()
    # The same request may come again (the source retries later): nothing remembers it.
    again = role.admit_migration(MIGRATION)
    assert again.ok, again
    await _receive_ended(role, "r1")
    assert role.stats().migrations_in_failed_total == failed_before + 2
    assert _items(streamer) == [] and bm.num_reserved_blocks == 0
    bm.check_integrity()


async def test_a_failed_receive_from_a_prefill_worker_still_ends_the_stream(
    peer: tuple[DecodeRole, TokenStreamer],
) -> None:
    role, streamer = peer
    bm = role.bm
    failed_before = role.stats().migrations_in_failed_total
    reply = role.admit(
        AdmitRequest(
            request_id="r2",
            router_id="rt",
            prompt_len=40,
            max_tokens=20,
            prefill_worker_id="p0",
            sampling=SamplingParams(max_tokens=20, seed=3),
            tokens_subject="tokens.rt",
        )
    )
    assert reply.ok, reply
    await _receive_ended(role, "r2")
    items = _items(streamer)
    assert [(i.request_id, i.finish_reason, i.error_code) for i in items] == [
        ("r2", "error", "kv_transfer_timeout")
    ]
    assert role.table.drained() and role.stats().migrations_in_failed_total == failed_before
    assert bm.num_reserved_blocks == 0 and bm.num_free_blocks == bm.num_usable_blocks
    bm.check_integrity()


async def test_a_migration_for_a_request_cancelled_before_it_came_is_refused(
    peer: tuple[DecodeRole, TokenStreamer],
) -> None:
    """A cancel of the request reached this peer before the source's MigrateRequest (the
    router's, during an earlier move of it that failed): the migration is refused, so
    nothing decodes for nobody and no KV or batch slot is held; a cancel that comes after
    the accept still ends the receive and frees its reservation."""
    role, streamer = peer
    bm = role.bm
    early = dataclasses.replace(MIGRATION, request_id="r3")
    assert role.cancel("r3") is False  # unknown here: remembered
    reply = role.admit_migration(early)
    assert not reply.ok and reply.error is not None and "cancelled" in reply.error
    assert "r3" not in role.table.requests and role.table.drained()
    assert bm.num_reserved_blocks == 0 and bm.num_free_blocks == bm.num_usable_blocks
    bm.check_integrity()

    late = dataclasses.replace(MIGRATION, request_id="r4")
    reply = role.admit_migration(late)
    assert reply.ok, reply
    task = role.table.requests["r4"].receive_task
    assert task is not None
    assert role.cancel("r4") is True
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 5.0)
    assert role.table.drained() and _items(streamer) == []
    assert bm.num_reserved_blocks == 0 and bm.num_free_blocks == bm.num_usable_blocks
    bm.check_integrity()


async def test_a_request_cancelled_while_its_move_is_asked_is_not_moved(
    endpoints: tuple[StepEngine, TransferEndpoints],
    peer: tuple[DecodeRole, TokenStreamer],
    nats_server_module: NatsServer,
) -> None:
    """The router's cancel reaches the source (d0) while it asks d1 to take the request
    (the router does not know of d1 yet, so d1 gets no cancel of its own): the source must
    not move it anyway, or d1 would decode it for nobody, holding KV and a batch slot. It
    tells d1 to drop its reservation and ends the request here. The source runs in this
    process beside d1 (one UCX node, d1's; its KV would go to d1 over it); real nats."""
    role1, _ = peer
    node = endpoints[1].node
    engine0, receiver0, role0, _ = _source(node, "r5")
    bm0, bm1 = engine0.block_manager, role1.bm
    subjects = Subjects(prefix=f"t{os.urandom(3).hex()}")
    cancels: list[str] = []

    async def on_migrate(msg: MigrateRequest) -> AdmitReply:
        role0.cancel(msg.request_id)  # the client left: the router's cancel reaches d0
        return role1.admit_migration(msg)

    async def on_cancel(msg: CancelRequest) -> None:
        cancels.append(msg.request_id)
        role1.cancel(msg.request_id)

    async with Bus(BusConfig(servers=(nats_server_module.url,)), subjects) as bus:
        await bus.serve(subjects.worker_migrate("d1"), MigrateRequest, on_migrate)
        await bus.serve(subjects.worker_cancel("d1"), CancelRequest, on_cancel)
        migrator, sender0 = _migrator(bus, subjects, node, engine0, role0, 2.0)
        assert await migrator.migrate_out("r5", ["d1"]) is True  # it no longer runs here
        assert role0.table.drained() and bm0.num_free_blocks == bm0.num_usable_blocks
        bm0.check_integrity()
        deadline = asyncio.get_running_loop().time() + 5.0
        while not (role1.table.drained() and bm1.num_reserved_blocks == 0):
            assert asyncio.get_running_loop().time() < deadline, (
                role1.table.requests,
                bm1.sequences(),
            )
            await asyncio.sleep(0.01)
        assert cancels == ["r5"] and "r5" not in bm1.sequences()
        assert bm1.num_free_blocks == bm1.num_usable_blocks
        bm1.check_integrity()
        sender0.close()
    receiver0.close()


async def test_a_move_whose_verdict_is_lost_ends_clearly_and_runs_nowhere(
    endpoints: tuple[StepEngine, TransferEndpoints],
    peer: tuple[DecodeRole, TokenStreamer],
    nats_server_module: NatsServer,
) -> None:
    """d1 installs the request but its "installed" verdict never reaches d0 (lost): d0's
    send ends at its deadline after its last message went out, so the outcome is unknown.
    d0 must not resume the request (it may run on d1) and must not leave it hanging: its
    stream ends with ``migration_failed``, and d1 is told to drop its copy, so the request
    runs nowhere and both pools are whole again. Real UCX and nats, d0 beside d1."""
    role1, _ = peer
    transfer = endpoints[1]
    engine0, receiver0, role0, streamer0 = _source(transfer.node, "r6")
    bm0, bm1 = engine0.block_manager, role1.bm
    subjects = Subjects(prefix=f"t{os.urandom(3).hex()}")
    cancels: list[str] = []
    receiver1 = transfer.receiver

    async def lost(env: object, ok: bool, reason: str) -> None:
        del receiver1._send_verdict  # one shot: the class's method again

    async def on_migrate(msg: MigrateRequest) -> AdmitReply:
        return role1.admit_migration(msg)

    async def on_cancel(msg: CancelRequest) -> None:
        cancels.append(msg.request_id)
        role1.cancel(msg.request_id)

    receiver1._send_verdict = lost  # type: ignore[method-assign]
    async with Bus(BusConfig(servers=(nats_server_module.url,)), subjects) as bus:
        await bus.serve(subjects.worker_migrate("d1"), MigrateRequest, on_migrate)
        await bus.serve(subjects.worker_cancel("d1"), CancelRequest, on_cancel)
        migrator, sender0 = _migrator(bus, subjects, transfer.node, engine0, role0, 1.0)
        assert await migrator.migrate_out("r6", ["d1"]) is True  # not resumed here
        ends = [i for i in _items(streamer0) if i.request_id == "r6" and i.finish_reason]
        assert [(i.finish_reason, i.error_code) for i in ends] == [("error", "migration_failed")]
        assert role0.table.drained() and bm0.num_free_blocks == bm0.num_usable_blocks
        bm0.check_integrity()
        table1 = role1.table
        async with asyncio.timeout(5.0):  # d1 installed it, then the cancel frees it
            while "r6" in table1.requests or "r6" in bm1.sequences():
                table1.progress.clear()
                if "r6" not in table1.requests and "r6" not in bm1.sequences():
                    break
                await table1.progress.wait()
        assert cancels == ["r6"] and table1.drained()
        assert bm1.num_free_blocks == bm1.num_usable_blocks and bm1.num_reserved_blocks == 0
        bm1.check_integrity()
        sender0.close()
    receiver0.close()


async def _no_flush() -> None:
    """The source's token flush: nothing to flush in this test (no router listens)."""
