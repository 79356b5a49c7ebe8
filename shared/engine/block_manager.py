"""The block manager: the single owner of KV-block metadata.

Only this class mutates free lists, reference counts, reservations, generation ids and block
tables. Everything else asks it. It never touches KV bytes itself; ``zero_fn`` (given by the
arena's owner) is called on blocks about to return to the free list when zeroing is wanted.

Block lifecycle::

    free --allocate()--> owned by a sequence (ref count >= 1, in its block table)
    free --reserve()---> reserved for a request whose KV has not arrived yet (not readable)
    reserved --install()--> owned by a sequence (one step: the request becomes runnable)
    reserved --cancel_reservation()--> free, but only once no receive into it is posted
    owned --free_sequence()--> ref count - 1; at 0 back to free
    free --lend_tail()--> lent out of the pool (the prefill workspace of a role switch)
    lent --reclaim_lent()--> free

Every allocation (by allocate, reserve or append) bumps the block's generation id, so a stale
envelope or a late write that names an old generation can be detected.

Free blocks are handed out in FIFO order (freed blocks go to the back), so block ids are
deterministic for a given call sequence: tests assert exact ids.

Thread-safety: none. The worker calls it from its event-loop thread only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shared.errors import BlockStateError, NoFreeBlocksError


@dataclass
class _Reservation:
    block_ids: list[int]
    receives_in_flight: int = 0
    cancelled: bool = False


@dataclass(frozen=True)
class ReservationInfo:
    """What a receiver tells a sender: where to write and which generations to expect."""

    owner: str
    block_ids: tuple[int, ...]
    generations: tuple[int, ...]


@dataclass
class BlockManagerStats:
    allocated_blocks_total: int = 0
    freed_blocks_total: int = 0
    reservations_total: int = 0
    reservations_cancelled_total: int = 0
    installs_total: int = 0
    zeroed_blocks_total: int = 0


class BlockManager:
    """Owns free list, ref counts, reservations, generation ids and block tables."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        zero_fn: Callable[[Sequence[int]], None] | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._zero_fn = zero_fn
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks
        self._ref_count = [0] * num_blocks
        self._generation = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._num_tokens: dict[str, int] = {}
        self._reservations: dict[str, _Reservation] = {}
        self._lent: range = range(num_blocks, num_blocks)
        self.stats = BlockManagerStats()

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        """The pool's capacity now: every block except those lent out (``lend_tail``)."""
        return self.num_blocks - len(self._lent)

    @property
    def lent_blocks(self) -> range:
        """Block ids lent out of the pool (empty range when none)."""
        return self._lent

    @property
    def num_reserved_blocks(self) -> int:
        return sum(len(r.block_ids) for r in self._reservations.values())

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def has_sequence(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def block_table(self, seq_id: str) -> tuple[int, ...]:
        """Block ids of ``seq_id`` in logical order. Raises BlockStateError if unknown."""
        try:
            return tuple(self._tables[seq_id])
        except KeyError:
            raise BlockStateError(f"unknown sequence {seq_id!r}") from None

    def num_tokens(self, seq_id: str) -> int:
        return self._num_tokens[seq_id]

    def generation(self, block_id: int) -> int:
        return self._generation[block_id]

    def generations(self, block_ids: Sequence[int]) -> tuple[int, ...]:
        return tuple(self._generation[b] for b in block_ids)

    def sequences(self) -> tuple[str, ...]:
        return tuple(self._tables)

    def reservations(self) -> tuple[str, ...]:
        return tuple(self._reservations)

    def reservation(self, owner: str) -> ReservationInfo:
        res = self._reservation(owner)
        return ReservationInfo(owner, tuple(res.block_ids), self.generations(res.block_ids))

    # -------------------------------------------------------------- internals
    def _take(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(num_blocks, len(self._free))
        out = [self._free.popleft() for _ in range(num_blocks)]
        for b in out:
            self._is_free[b] = False
            self._generation[b] += 1
        self.stats.allocated_blocks_total += num_blocks
        return out

    def _give_back(self, block_ids: Sequence[int]) -> None:
        if not block_ids:
            return
        for b in block_ids:
            if self._is_free[b]:
                raise BlockStateError(f"double free of block {b}")
        if self._zero_fn is not None:
            self._zero_fn(block_ids)
            self.stats.zeroed_blocks_total += len(block_ids)
        for b in block_ids:
            self._is_free[b] = True
            self._ref_count[b] = 0
            self._free.append(b)
        self.stats.freed_blocks_total += len(block_ids)

    def _reservation(self, owner: str) -> _Reservation:
        try:
            return self._reservations[owner]
        except KeyError:
            raise BlockStateError(f"no reservation for {owner!r}") from None

    # ------------------------------------------------------------- sequences
    def allocate(self, seq_id: str, num_tokens: int) -> tuple[int, ...]:
        """Create ``seq_id`` with blocks for ``num_tokens`` tokens.

        Raises NoFreeBlocksError (nothing changed) or BlockStateError if the id exists.
        """
        if seq_id in self._tables or seq_id in self._reservations:
            raise BlockStateError(f"sequence {seq_id!r} already exists")
        blocks = self._take(self.blocks_for_tokens(num_tokens))
        for b in blocks:
            self._ref_count[b] = 1
        self._tables[seq_id] = blocks
        self._num_tokens[seq_id] = num_tokens
        return tuple(blocks)

    def grow(self, seq_id: str, new_num_tokens: int) -> tuple[int, ...]:
        """Make room for ``new_num_tokens`` tokens in total; returns the newly added block ids.

        Raises NoFreeBlocksError (nothing changed) when the pool is short.
        """
        table = self._tables.get(seq_id)
        if table is None:
            raise BlockStateError(f"unknown sequence {seq_id!r}")
        if new_num_tokens < self._num_tokens[seq_id]:
            raise BlockStateError("a sequence cannot shrink")
        extra = self.blocks_for_tokens(new_num_tokens) - len(table)
        added = self._take(extra) if extra > 0 else []
        for b in added:
            self._ref_count[b] = 1
        table.extend(added)
        self._num_tokens[seq_id] = new_num_tokens
        return tuple(added)

    def free_sequence(self, seq_id: str) -> None:
        """Drop ``seq_id``; blocks whose ref count reaches 0 return to the free list.

        Raises BlockStateError if unknown (a double free of a sequence).
        """
        table = self._tables.pop(seq_id, None)
        if table is None:
            raise BlockStateError(f"unknown sequence {seq_id!r}")
        del self._num_tokens[seq_id]
        released = []
        for b in table:
            self._ref_count[b] -= 1
            if self._ref_count[b] == 0:
                released.append(b)
        self._give_back(released)

    # ----------------------------------------------------------- reservations
    def reserve(self, owner: str, num_blocks: int) -> ReservationInfo:
        """Set aside ``num_blocks`` for an incoming transfer. Counts against capacity at once.

        Raises NoFreeBlocksError (nothing changed) or BlockStateError if ``owner`` exists.
        """
        if owner in self._reservations or owner in self._tables:
            raise BlockStateError(f"{owner!r} already holds blocks")
        blocks = self._take(num_blocks)
        self._reservations[owner] = _Reservation(blocks)
        self.stats.reservations_total += 1
        return ReservationInfo(owner, tuple(blocks), self.generations(blocks))

    def begin_receive(self, owner: str) -> None:
        """A receive into ``owner``'s blocks is being posted; blocks stay pinned until end."""
        res = self._reservation(owner)
        if res.cancelled:
            raise BlockStateError(f"reservation {owner!r} is cancelled")
        res.receives_in_flight += 1

    def end_receive(self, owner: str) -> None:
        """A posted receive completed or was cancelled. Frees a cancelled reservation at 0."""
        res = self._reservation(owner)
        if res.receives_in_flight <= 0:
            raise BlockStateError(f"no receive in flight for {owner!r}")
        res.receives_in_flight -= 1
        if res.cancelled and res.receives_in_flight == 0:
            del self._reservations[owner]
            self._give_back(res.block_ids)

    def cancel_reservation(self, owner: str) -> bool:
        """Release ``owner``'s reservation. Returns True if its blocks are free now.

        If receives are still posted, the blocks stay out of the free list until the last
        ``end_receive`` — a late write can never land in another request's blocks.
        """
        res = self._reservation(owner)
        if res.cancelled:
            return False
        res.cancelled = True
        self.stats.reservations_cancelled_total += 1
        if res.receives_in_flight == 0:
            del self._reservations[owner]
            self._give_back(res.block_ids)
            return True
        return False

    def install(self, owner: str, num_tokens: int, seq_id: str | None = None) -> tuple[int, ...]:
        """Turn a fully received reservation into a sequence's block table, in one step.

        ``num_tokens`` tokens must fit in the reserved blocks; blocks beyond them stay with the
        sequence (room to decode into). Raises BlockStateError while receives are in flight.
        """
        res = self._reservation(owner)
        seq_id = owner if seq_id is None else seq_id
        if res.cancelled or res.receives_in_flight:
            raise BlockStateError(f"reservation {owner!r} is not complete")
        if self.blocks_for_tokens(num_tokens) > len(res.block_ids):
            raise BlockStateError(f"{num_tokens} tokens do not fit {len(res.block_ids)} blocks")
        if seq_id in self._tables:
            raise BlockStateError(f"sequence {seq_id!r} already exists")
        del self._reservations[owner]
        for b in res.block_ids:
            self._ref_count[b] = 1
        self._tables[seq_id] = list(res.block_ids)
        self._num_tokens[seq_id] = num_tokens
        self.stats.installs_total += 1
        return tuple(res.block_ids)

    # ------------------------------------------------------------------ re-slice
    def lend_tail(self, num_blocks: int) -> range:
        """Take the ``num_blocks`` highest block ids out of the pool (they are one
        contiguous byte range of a block-major arena) and return them; capacity shrinks
        by as much until ``reclaim_lent``. Mutates the free list.

        Raises BlockStateError (nothing changed) if blocks are already lent or any of
        those blocks is in use; ValueError if ``num_blocks`` is not in [1, num_blocks).
        """
        if not 0 < num_blocks < self.num_blocks:
            raise ValueError(f"cannot lend {num_blocks} of {self.num_blocks} blocks")
        if self._lent:
            raise BlockStateError("blocks are already lent")
        tail = range(self.num_blocks - num_blocks, self.num_blocks)
        busy = [b for b in tail if not self._is_free[b]]
        if busy:
            raise BlockStateError(f"{len(busy)} of the tail blocks are in use")
        lent = set(tail)
        self._free = deque(b for b in self._free if b not in lent)
        for b in tail:
            self._is_free[b] = False
        self._lent = tail
        return tail

    def reclaim_lent(self) -> int:
        """Return lent blocks to the back of the free list (zeroed first when zeroing is
        on; their generation bumps when next handed out). Returns how many came back; 0
        when none were lent."""
        tail, self._lent = self._lent, range(self.num_blocks, self.num_blocks)
        if tail and self._zero_fn is not None:  # the workspace held gathered KV
            self._zero_fn(tail)
            self.stats.zeroed_blocks_total += len(tail)
        for b in tail:
            self._is_free[b] = True
            self._free.append(b)
        return len(tail)

    # -------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant is broken. Tests call this."""
        owned: dict[int, int] = {}
        for seq_id, table in self._tables.items():
            needed = self.blocks_for_tokens(self._num_tokens[seq_id])
            assert len(table) >= needed, f"{seq_id}: block table too short"
            for b in table:
                owned[b] = owned.get(b, 0) + 1
        reserved: set[int] = set()
        for owner, res in self._reservations.items():
            assert res.receives_in_flight >= 0, owner
            for b in res.block_ids:
                assert b not in reserved and b not in owned, f"block {b} held twice"
                reserved.add(b)
        for b in self._lent:
            assert b not in owned and b not in reserved, f"lent block {b} is in use"
        free = list(self._free)
        free_set = set(free)
        assert len(free) == len(free_set), "duplicate in free list"
        for b in range(self.num_blocks):
            assert self._is_free[b] == (b in free_set), f"block {b}: free flag disagrees"
            if b in free_set:
                assert b not in owned and b not in reserved, f"free block {b} is in use"
                assert self._ref_count[b] == 0, f"free block {b} has refs"
            elif b in owned:
                assert self._ref_count[b] == owned[b], f"block {b} ref count mismatch"
            else:
                assert b in reserved or b in self._lent, f"block {b} leaked"
        accounted = len(free) + len(owned) + len(reserved) + len(self._lent)
        assert accounted == self.num_blocks, "blocks unaccounted"
