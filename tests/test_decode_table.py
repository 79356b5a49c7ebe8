"""The decode role's request table (services/worker/decode/decode_table.py) on a real block
manager: cancels before and during a step, migration freeze/unfreeze, and that every way
out frees the request's blocks (check_integrity after each)."""

from __future__ import annotations

import asyncio

from services.worker.decode.decode_request import DecodeRequest
from services.worker.decode.decode_table import DecodeTable
from services.worker.token_stream import TokenStreamer
from shared.engine.block_manager import BlockManager
from shared.engine.sequence import Sequence
from shared.messages import StreamSequencer
from shared.sampling_params import SamplingParams

BLOCKS, BLOCK_SIZE = 16, 4


def _table() -> tuple[DecodeTable, BlockManager, TokenStreamer, list[int]]:
    bm = BlockManager(BLOCKS, BLOCK_SIZE)
    streamer = TokenStreamer(StreamSequencer("d0"))
    flushes: list[int] = []
    return DecodeTable(bm, streamer, lambda: flushes.append(1)), bm, streamer, flushes


def _runnable(table: DecodeTable, bm: BlockManager, rid: str, prompt_len: int) -> DecodeRequest:
    bm.allocate(rid, prompt_len)
    seq = Sequence(rid, [1] * prompt_len, SamplingParams(max_tokens=8))
    req = DecodeRequest(rid, f"router.r.tokens.{rid}", seq, 0.0)
    table.requests[rid] = req
    table.make_runnable(req)
    return req


def test_cancel_of_a_runnable_request_frees_its_blocks_at_once() -> None:
    table, bm, _, _ = _table()
    _runnable(table, bm, "a", 10)
    assert bm.num_free_blocks == BLOCKS - 3 and table.wakeup.is_set()
    assert table.cancel("a") is True
    assert not table.requests and not table.runnable and table.drained()
    assert bm.num_free_blocks == BLOCKS and table.progress.is_set()
    bm.check_integrity()


def test_cancel_during_a_step_waits_for_the_step() -> None:
    table, bm, _, _ = _table()
    _runnable(table, bm, "a", 10)
    table.in_step = {"a"}
    assert table.cancel("a") is True
    assert "a" in table.doomed and bm.has_sequence("a")  # the step may still write its KV
    bm.check_integrity()


def test_a_cancel_that_overtakes_its_admit_is_remembered() -> None:
    table, _, _, _ = _table()
    assert table.cancel("late") is False
    assert "late" in table.cancelled  # the intake refuses that admit when it comes


def test_a_cancel_for_a_migrated_request_names_the_peer() -> None:
    table, bm, _, _ = _table()
    req = _runnable(table, bm, "m", 6)
    table.migrated(req, "d1")
    assert bm.num_free_blocks == BLOCKS and table.migrations_out_total == 1
    assert table.cancel("m") is True  # the handler forwards it
    assert table.take_migrated_peer("m") == "d1" and table.take_migrated_peer("m") is None
    bm.check_integrity()


async def test_freeze_waits_for_the_step_and_unfreeze_honours_a_cancel() -> None:
    table, bm, _, _ = _table()
    req = _runnable(table, bm, "f", 6)
    table.in_step = {"f"}
    freezing = asyncio.ensure_future(table.freeze("f"))
    await asyncio.sleep(0)  # one loop turn: freeze runs up to its wait for step_done
    assert not freezing.done() and req.migrating  # held until the step commits
    table.in_step = set()
    table.step_done.set()
    async with asyncio.timeout(5.0):
        assert await freezing is req
    assert table.cancel("f") is True and "f" in table.doomed  # frozen: freed on unfreeze
    table.unfreeze(req)
    assert not table.requests and bm.num_free_blocks == BLOCKS
    bm.check_integrity()


def test_fail_frozen_ends_the_stream_with_an_error_and_frees_the_blocks() -> None:
    table, bm, streamer, flushes = _table()
    req = _runnable(table, bm, "x", 6)
    req.migrating = True
    table.fail_frozen(req, "outcome unknown", "migration_failed")
    assert len(streamer) == 1 and flushes == [1]
    assert not table.requests and bm.num_free_blocks == BLOCKS
    bm.check_integrity()


def test_pending_prompt_tokens_counts_suffixes_and_unrun_prompts() -> None:
    table, bm, _, _ = _table()
    req = _runnable(table, bm, "p", 10)  # a local prompt: 10 tokens not computed yet
    receiving = DecodeRequest("s", "t", Sequence("s", [0] * 8, SamplingParams()), 0.0)
    receiving.suffix_token_ids = (5, 6, 7)
    table.requests["s"] = receiving
    assert table.pending_prompt_tokens() == 13
    assert table.num_running == 1 and table.num_receiving == 1
    req.seq.num_cached_tokens = 10  # prompt computed: one token pending = decoding
    assert table.pending_prompt_tokens() == 3


def test_the_decode_flow_counts_every_request_into_and_out_of_the_batch() -> None:
    # FluidRole's decode flow forecast (shared/policy/decode_flow.py) reads these counters.
    table, bm, _, _ = _table()
    done = _runnable(table, bm, "done", 4)
    moved = _runnable(table, bm, "moved", 4)
    _runnable(table, bm, "cancelled", 4)
    assert (table.entered_total, table.left_total) == (3, 0)
    table.finish(done)
    table.migrated(moved, "d1")
    assert table.cancel("cancelled") is True
    assert (table.entered_total, table.left_total) == (3, 3)
    # A request still receiving its KV never joined the batch: its cancel is no departure.
    seq = Sequence("rx", [1] * 4, SamplingParams(max_tokens=8))
    table.requests["rx"] = DecodeRequest("rx", "router.r.tokens.rx", seq, 0.0)
    assert table.cancel("rx") is True
    table.finish(done)  # finishing twice counts once
    assert (table.entered_total, table.left_total) == (3, 3)
    bm.check_integrity()
