"""Landing one transfer's segments: a UCX receive per segment posted straight into the arena
(each pinned with ``begin_receive`` until UCX completes it), checksums computed as the
segments land, then the trailer. Used by ``KVReceiver`` (receiver.py), which owns the
receive's lifecycle; what is checked afterwards is receive_checks.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

from shared.engine.block_manager import BlockManager
from shared.engine.kv_arena import KVArena
from shared.transfer import protocol as proto
from shared.transfer.checksum import BlockHasher
from shared.transfer.errors import TransportError
from shared.transfer.inbound import Inbound
from shared.transfer.landed_hasher import LandedHasher
from shared.transfer.ucx_node import TransferNode

_INLINE_HASH_BYTES = 1 << 20


class SegmentLanding:
    """Lands segments in one worker's arena. Holds the hash thread and the hashers."""

    def __init__(self, node: TransferNode, block_manager: BlockManager, arena: KVArena) -> None:
        self._node = node
        self._bm = block_manager
        self._arena = arena
        self._hasher = LandedHasher()  # one thread, started at the first large receive
        self._hashers: dict[str, BlockHasher] = {}  # by algorithm, on the arena's device

    async def collect(
        self, st: Inbound, dst: tuple[int, ...], trailer_req: Any, *, verify_checksums: bool
    ) -> list[int]:
        """Post one receive per segment straight into the arena, checksum the segments as
        they land, then wait for the trailer. Returns the checksums in logical order
        (none without ``verify_checksums``). Mutates ``st`` (pins, marks, segments_done);
        raises TransportError (the sender noted as failed).

        On one host the copy runs inside UCX calls (posting a receive whose message is
        already there, or one worker progress that serves several segments back to back),
        with the GIL released but the event loop blocked: hashing dispatched from the loop
        would start only after the copy (measured: +8 ms per 256 MiB). So a hash thread
        follows the segments itself (``LandedHasher``) while the loop keeps copying.
        Small transfers hash inline: a thread hop costs more than the hash.
        """
        loop = asyncio.get_running_loop()
        assert st.envelope is not None
        env, request_id = st.envelope, st.ticket.request_id
        block_nbytes = self._arena.block_nbytes
        hasher = self._block_hasher(env.checksum_algorithm) if verify_checksums else None
        on_device = self._arena.tensor.device.type != "cpu"
        views: list[Any] = []
        follower: asyncio.Future[list[int]] | None = None
        if hasher is not None and (
            on_device or env.num_blocks * block_nbytes >= _INLINE_HASH_BYTES
        ):  # on CUDA always: the hash waits for its kernels, which must not hold the loop
            follower = self._hasher.follow(
                st.pinned, views, len(env.segments), hasher, st.hash_stop
            )
        for k, (first, count) in enumerate(env.segments):
            view = self._arena.run_bytes(dst[first], count)
            views.append(view)  # before its receive: the follower reads both
            self._bm.begin_receive(request_id)
            try:
                req = self._node.post_recv(view, proto.segment_tag(st.ticket.transfer_id, k))
            except BaseException:
                self._bm.end_receive(request_id)
                raise
            st.pinned.append(req)
        for req in st.pinned:
            try:
                await self._node.wait(req)
            except TransportError:
                # On one host this is a failed copy of the sender's memory: it is gone.
                self._node.note_peer_failure(env.src_address)
                raise
            st.segments_done += 1
        st.marks["segments_landed"] = loop.time()
        sums: list[int] = []
        if follower is not None:
            sums = await follower
        elif hasher is not None:
            sums = [c for run in views for c in hasher(run)]
        st.marks["hashed"] = loop.time()
        await self._node.wait(trailer_req)
        return sums

    def _block_hasher(self, algorithm: str) -> BlockHasher:
        """The hasher for ``algorithm`` on this arena's device (checked by check_envelope)."""
        if algorithm not in self._hashers:
            self._hashers[algorithm] = BlockHasher(
                algorithm, self._arena.block_nbytes, self._arena.tensor.device
            )
        return self._hashers[algorithm]

    def close(self) -> None:
        """Stop the hash thread."""
        self._hasher.close()
