"""LandedHasher: checksums of landed segments, in order, and no receive waits behind another.

The receives here are plain objects with a ``completed`` flag (what the hasher reads of a
UCX op); the real-UCX path is covered by tests/test_transfer.py (flipped byte in a 2 MiB,
many-segment transfer)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import numpy as np
import pytest

from shared.transfer.checksum import XXH3, BlockHasher
from shared.transfer.envelope import block_checksums
from shared.transfer.landed_hasher import LandedHasher

BLOCK = 4096
XXH3_BLOCK = BlockHasher(XXH3, BLOCK)


@dataclass
class FakeOp:
    completed: bool = False


def runs(seed: int, num_segments: int, blocks_per_segment: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        rng.integers(0, 256, BLOCK * blocks_per_segment, dtype=np.uint8)
        for _ in range(num_segments)
    ]


async def test_segments_hashed_in_order_as_they_land() -> None:
    hasher = LandedHasher()
    data = runs(1, 3, 2)
    ops: list[FakeOp] = []
    views: list[np.ndarray] = []
    fut = hasher.follow(ops, views, 3, XXH3_BLOCK, threading.Event())
    for run in data:  # posted one by one, landing out of order
        views.append(run)
        ops.append(FakeOp())
    ops[2].completed = True
    ops[0].completed = True
    await asyncio.sleep(0.01)
    assert not fut.done()  # segment 1 has not landed: nothing past it is reported
    ops[1].completed = True
    sums = await asyncio.wait_for(fut, 5)
    assert sums == [c for run in data for c in block_checksums(run, BLOCK)]
    hasher.close()


async def test_a_stalled_receive_holds_up_no_other() -> None:
    hasher = LandedHasher()
    stalled_stop = threading.Event()
    stalled_ops = [FakeOp(completed=True), FakeOp()]  # its second segment never lands
    stalled = hasher.follow(stalled_ops, runs(2, 2, 1), 2, XXH3_BLOCK, stalled_stop)
    data = runs(3, 4, 3)
    ops = [FakeOp(completed=True) for _ in data]
    fine = hasher.follow(ops, data, 4, XXH3_BLOCK, threading.Event())
    sums = await asyncio.wait_for(fine, 5)
    assert sums == [c for run in data for c in block_checksums(run, BLOCK)]
    assert not stalled.done()
    stalled_stop.set()  # the receiver gave up (deadline): a partial list, then discarded
    assert len(await asyncio.wait_for(stalled, 5)) == 1
    hasher.close()


async def test_close_ends_followed_receives_and_refuses_new_ones() -> None:
    hasher = LandedHasher()
    pending = hasher.follow([FakeOp()], runs(4, 1, 1), 1, XXH3_BLOCK, threading.Event())
    hasher.close()
    assert await asyncio.wait_for(pending, 5) == []
    with pytest.raises(RuntimeError):
        hasher.follow([], [], 1, XXH3_BLOCK, threading.Event())
