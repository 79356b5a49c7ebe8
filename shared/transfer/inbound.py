"""One receive in progress (``Inbound``: what it has posted into the arena) and how a
failed one lets go of its blocks (``InboundReleaser``): the reservation is cancelled at
once, but a block pinned by a posted UCX receive is released only once UCX reports that
receive complete, or its sender is known dead — so a late write can never land in blocks
another request owns (docs/transfer.md, ownership).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from shared.engine.block_manager import BlockManager
from shared.transfer.envelope import Envelope, TransferTicket
from shared.transfer.ucx_node import TransferNode

log = logging.getLogger(__name__)


@dataclass
class Inbound:
    """The receiver's record of one transfer. Mutated by the receiver and the releaser."""

    ticket: TransferTicket
    pinned: list[Any] = field(default_factory=list)  # segment receives (begin_receive'd)
    control: list[Any] = field(default_factory=list)  # envelope/trailer/abort receives
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    envelope: Envelope | None = None
    segments_done: int = 0
    sender_aborted: bool = False
    marks: dict[str, float] = field(default_factory=dict)  # loop.time() of data milestones
    hash_stop: threading.Event = field(default_factory=threading.Event)  # ends the follower


class InboundReleaser:
    """Lets go of what receives hold, through the block manager's API only. Keeps the
    background drains of receives UCX has not let go of yet alive until they end."""

    def __init__(self, node: TransferNode, block_manager: BlockManager) -> None:
        self.node = node
        self.bm = block_manager
        self._drains: set[asyncio.Task[None]] = set()

    async def settle_control(self, st: Inbound) -> None:
        """Cancel ``st``'s helper tasks and settle its control receives. Mutates ``st``."""
        for task in st.tasks:
            task.cancel()
        for req in st.control:
            await self.node.settle(req)
        st.control.clear()

    async def release(self, st: Inbound) -> None:
        """Cancel ``st``'s reservation, settle its control receives and unpin every segment
        receive that UCX let go of; a receive still posted stays pinned and is drained in
        the background. Mutates ``st`` (``pinned`` emptied). Never raises for the
        reservation (it may already be gone)."""
        owner = st.ticket.request_id
        with contextlib.suppress(Exception):
            self.bm.cancel_reservation(owner)
        await self.settle_control(st)
        src = st.envelope.src_address if st.envelope is not None else b""
        for req in st.pinned:
            if await self.node.settle(req) or self._peer_gone(src, owner):
                self.bm.end_receive(owner)
            else:  # still posted: keep the blocks pinned until UCX lets go of them
                task = asyncio.create_task(self._drain(req, owner, src))
                self._drains.add(task)
                task.add_done_callback(self._drains.discard)
        st.pinned.clear()

    def _peer_gone(self, src_address: bytes, owner: str) -> bool:
        """A receive that did not settle may be released only when its sender is known
        dead: UCX dropped its RTS (ucx_guard, case 1) and the only possible writer, our own
        copy from the sender's memory, can no longer run."""
        if not src_address or not self.node.peer_failed(src_address):
            return False
        log.warning("kv receive from a dead sender released unsettled owner=%s", owner)
        return True

    async def _drain(self, req: Any, owner: str, src_address: bytes) -> None:
        while not await self.node.settle(req, grace_s=1.0):
            if self._peer_gone(src_address, owner):
                break
            log.warning("kv receive still posted after cancel owner=%s", owner)
        self.bm.end_receive(owner)
