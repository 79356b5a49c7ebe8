"""A decode worker's intake when a KV receive fails, in-process: the emulated tiny engine
and a real UCX receiver (services/worker/decode/decode_intake.py). Nothing ever sends, so
each receive ends at its deadline, through the receiver's real failure path.

* An incoming live migration: the source owns the move's outcome (it resumes the request
  or moves it on), so the peer ends it without an item on the request's stream; its
  reservation is freed and nothing is left in its table or block manager.
* A plain admit from a prefill worker: the error item still ends the stream (the prefill
  worker does not retry a failed export).

The same fault on real processes, through the router: test_fail_migration.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import pytest_asyncio

from services.worker.config import WorkerConfig
from services.worker.decode.decode_role import DecodeRole
from services.worker.engine_factory import build_engine
from services.worker.token_stream import TokenStreamer
from services.worker.transfer_endpoints import open_transfer
from shared.messages import (
    AdmitRequest,
    MigrateRequest,
    SamplingParams,
    StreamSequencer,
    TokenBatch,
    TokenItem,
)
from shared.policy.roles import DECODE

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


@pytest_asyncio.fixture(loop_scope="module", scope="module")  # UCX: one node per process
async def peer() -> AsyncIterator[tuple[DecodeRole, TokenStreamer]]:
    cfg = WorkerConfig(
        worker_id="d1", role=DECODE, engine="emulated", num_kv_blocks=32, cluster_secret="s" * 32
    )
    engine = build_engine(cfg)
    streamer = TokenStreamer(StreamSequencer("d1"))
    async with contextlib.AsyncExitStack() as stack:
        executor = stack.enter_context(ThreadPoolExecutor(1))
        receiver = (await open_transfer(cfg, engine, stack)).receiver
        role = DecodeRole(
            engine,
            receiver,
            streamer,
            executor,
            lambda: None,
            transfer_timeout_s=TRANSFER_TIMEOUT_S,
            max_num_seqs=8,
        )
        yield role, streamer


def _items(streamer: TokenStreamer) -> list[TokenItem]:
    return [i for _, b in streamer.take() if isinstance(b, TokenBatch) for i in b.items]


async def _receive_ended(role: DecodeRole, request_id: str) -> None:
    task = role.table.requests[request_id].receive_task
    assert task is not None
    await asyncio.wait_for(task, TRANSFER_TIMEOUT_S + 5.0)


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
    """The router's cancel reached this peer (in custody since the hand-over item) before
    the source's MigrateRequest: the migration is refused, so nothing decodes for nobody
    and no KV or batch slot is held; a cancel that comes after the accept still ends the
    receive and frees its reservation."""
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
