"""Block manager: exact ids, ownership rules, and invariants under random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.engine.block_manager import BlockManager
from shared.errors import BlockStateError, NoFreeBlocksError


def test_allocate_grow_free_exact_ids() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.allocate("a", 5) == (0, 1)
    assert bm.allocate("b", 1) == (2,)
    assert bm.grow("a", 9) == (3,)
    assert bm.grow("a", 12) == ()
    assert bm.block_table("a") == (0, 1, 3)
    bm.free_sequence("a")
    # FIFO: blocks 4, 5 were never used, then the freed 0, 1, 3 in table order.
    assert bm.allocate("c", 16) == (4, 5, 0, 1)
    bm.check_integrity()
    assert bm.num_free_blocks == 1


def test_generation_bumps_on_every_reuse() -> None:
    bm = BlockManager(num_blocks=1, block_size=4)
    gens = []
    for i in range(3):
        bm.allocate(f"s{i}", 1)
        gens.append(bm.generation(0))
        bm.free_sequence(f"s{i}")
    assert gens == [1, 2, 3]


def test_not_enough_blocks_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate("a", 8)
    with pytest.raises(NoFreeBlocksError) as exc:
        bm.allocate("b", 9)
    assert exc.value.needed_blocks == 3 and exc.value.free_blocks == 1
    with pytest.raises(NoFreeBlocksError):
        bm.grow("a", 16)
    assert bm.block_table("a") == (0, 1) and bm.num_free_blocks == 1
    assert not bm.has_sequence("b")
    bm.check_integrity()


def test_double_free_is_an_error() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.allocate("a", 1)
    bm.free_sequence("a")
    with pytest.raises(BlockStateError):
        bm.free_sequence("a")
    bm.check_integrity()


def test_reservation_install_is_one_step() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    info = bm.reserve("r1", 3)
    assert info.block_ids == (0, 1, 2) and info.generations == (1, 1, 1)
    assert bm.num_free_blocks == 1 and bm.num_reserved_blocks == 3
    assert not bm.has_sequence("r1")
    bm.begin_receive("r1")
    with pytest.raises(BlockStateError):
        bm.install("r1", 10)
    bm.end_receive("r1")
    assert bm.install("r1", 10) == (0, 1, 2)
    assert bm.block_table("r1") == (0, 1, 2) and bm.num_reserved_blocks == 0
    bm.check_integrity()


def test_cancelled_reservation_stays_pinned_while_receive_posted() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.reserve("r", 2)
    bm.begin_receive("r")
    assert bm.cancel_reservation("r") is False
    # The blocks must not be handed out while the receive can still land in them.
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("other", 1)
    bm.check_integrity()
    bm.end_receive("r")
    assert bm.num_free_blocks == 2 and bm.reservations() == ()
    assert bm.allocate("other", 1) == (0,)
    assert bm.generation(0) == 2
    bm.check_integrity()


def test_zero_fn_called_on_release() -> None:
    zeroed: list[int] = []
    bm = BlockManager(num_blocks=3, block_size=4, zero_fn=zeroed.extend)
    bm.allocate("a", 9)
    bm.free_sequence("a")
    bm.reserve("r", 2)
    bm.cancel_reservation("r")
    assert zeroed == [0, 1, 2, 0, 1]


def test_lend_tail_takes_the_highest_ids_and_reclaim_returns_them() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 8) == (0, 1)
    assert bm.lend_tail(3) == range(5, 8)
    assert (bm.num_usable_blocks, bm.num_free_blocks) == (5, 3)
    assert bm.allocate("b", 12) == (2, 3, 4)  # the lent tail is never handed out
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("c", 1)
    with pytest.raises(BlockStateError):
        bm.lend_tail(1)  # one loan at a time
    bm.check_integrity()
    assert bm.reclaim_lent() == 3
    assert bm.allocate("c", 4) == (5,)  # back at the end of the free list, FIFO
    assert bm.reclaim_lent() == 0
    bm.check_integrity()


def test_lend_tail_refuses_blocks_in_use_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", 16)  # all four blocks
    bm.free_sequence("a")
    bm.allocate("b", 4)  # FIFO: block 0
    bm.reserve("r", 3)  # blocks 1, 2, 3
    with pytest.raises(BlockStateError):
        bm.lend_tail(2)
    assert (bm.lent_blocks, bm.num_usable_blocks) == (range(4, 4), 4)
    with pytest.raises(ValueError):
        bm.lend_tail(4)  # never the whole pool
    bm.check_integrity()


_ops = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "alloc",
                "grow",
                "free",
                "reserve",
                "begin",
                "end",
                "cancel",
                "install",
                "lend",
                "reclaim",
            ]
        ),
        st.integers(0, 5),
        st.integers(0, 40),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(_ops)
def test_invariants_under_random_operations(ops: list[tuple[str, int, int]]) -> None:
    bm = BlockManager(num_blocks=12, block_size=4)
    live: dict[str, int] = {}
    for op, idx, n in ops:
        name = f"x{idx}"
        try:
            if op == "alloc":
                bm.allocate(name, n)
                live[name] = n
            elif op == "grow":
                bm.grow(name, live.get(name, 0) + n)
                live[name] = live.get(name, 0) + n
            elif op == "free":
                bm.free_sequence(name)
                live.pop(name, None)
            elif op == "reserve":
                bm.reserve(name, n % 5)
            elif op == "begin":
                bm.begin_receive(name)
            elif op == "end":
                bm.end_receive(name)
            elif op == "cancel":
                bm.cancel_reservation(name)
            elif op == "install":
                bm.install(name, n % 20)
                live[name] = n % 20
            elif op == "lend":
                bm.lend_tail(1 + n % 11)
            elif op == "reclaim":
                bm.reclaim_lent()
        except (NoFreeBlocksError, BlockStateError):
            pass
        bm.check_integrity()
        assert bm.num_free_blocks <= bm.num_usable_blocks
    # Everything released -> every block free again, none lost.
    bm.reclaim_lent()
    for seq in bm.sequences():
        bm.free_sequence(seq)
    for owner in bm.reservations():
        bm.cancel_reservation(owner)
        while owner in bm.reservations():
            bm.end_receive(owner)
    bm.check_integrity()
    assert bm.num_free_blocks == 12
