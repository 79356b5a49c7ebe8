"""The decode role's request table, in one place: every request held here (``requests``),
the runnable ones in batch order (``runnable``), ids cancelled before their admit came or
moved to a peer, the requests of the running step (``in_step``) and those to free once it
commits (``doomed``), and the admits refused for capacity that still wait
(decode_waiting.py).

Owned by ``DecodeRole`` (decode_role.py); its intake (decode_intake.py) adds requests and
its batch loop runs them, both through this object, from the event loop only. Ending a
request (``finish``) is the one place a request's blocks go back to the block manager.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from services.worker.decode.decode_request import DecodeRequest, add_error_item
from services.worker.decode.decode_waiting import WaitingAdmissions
from services.worker.token_stream import TokenStreamer
from shared.engine.block_manager import BlockManager
from shared.messages import TokenItem
from shared.policy.roles import DECODE

_MAX_REMEMBERED_IDS = 4096  # bounded memory of migrated / early-cancelled request ids


class DecodeTable:
    """Mutated by its methods and by the role's intake and loop (event loop only)."""

    def __init__(
        self, bm: BlockManager, streamer: TokenStreamer, publish: Callable[[], Any]
    ) -> None:
        self.bm = bm
        self._streamer = streamer
        self._publish = publish
        self.requests: dict[str, DecodeRequest] = {}
        self.runnable: list[DecodeRequest] = []
        self.cancelled: dict[str, None] = {}  # ids cancelled before their admit arrived
        self.migrated_to: dict[str, str] = {}  # request id -> peer that now decodes it
        self.in_step: set[str] = set()
        self.doomed: set[str] = set()
        self.waiting = WaitingAdmissions()  # refused admits their prefill workers retry
        self.wakeup = asyncio.Event()  # the batch loop has work
        self.step_done = asyncio.Event()  # pulsed after every committed step
        self.progress = asyncio.Event()  # set when a request leaves (a D->P drain waits)
        self.migrations_out_total = 0
        # The decode flow (shared/policy/decode_flow.py): requests that joined the batch and
        # that left it (finished, cancelled, failed or migrated away), since start.
        self.entered_total = 0
        self.left_total = 0

    def make_runnable(self, req: DecodeRequest) -> None:
        """``req`` joins the batch (its KV is installed, or it needs none)."""
        req.phase = "runnable"
        self.runnable.append(req)
        self.entered_total += 1
        self.wakeup.set()

    def stream_error(self, req: DecodeRequest, error: str, code: str) -> None:
        """End ``req``'s token stream with an error item and ask for a flush. Does not drop
        the request: the caller does."""
        add_error_item(self._streamer, req, error, code)
        self._publish()

    def hand_over(self, req: DecodeRequest, peer_id: str) -> None:
        """Queue the notice that ``peer_id`` now decodes ``req`` (the router accepts a
        request's tokens only from workers it was told of; the caller flushes it before the
        peer can stream). Handing it back to this worker undoes a notice."""
        self._streamer.add(req.tokens_subject, TokenItem.hand_over(req.request_id, peer_id, DECODE))

    def finish(self, req: DecodeRequest) -> None:
        """Drop ``req`` and free its blocks."""
        self.requests.pop(req.request_id, None)
        self.progress.set()
        if req in self.runnable:
            self.runnable.remove(req)
            self.left_total += 1
        if self.bm.has_sequence(req.request_id):
            self.bm.free_sequence(req.request_id)

    # --------------------------------------------------------------------- cancel
    def cancel(self, request_id: str) -> bool:
        """Stop ``request_id`` and free its blocks (after the running step, if in one)."""
        self.waiting.drop(request_id)
        req = self.requests.get(request_id)
        if req is None:
            # Cancel and admit travel on different subjects, so a cancel can overtake the
            # admit it cancels (e.g. both queued while this process was stopped): remember
            # it, and refuse that admit when it comes.
            self.cancelled[request_id] = None
            while len(self.cancelled) > _MAX_REMEMBERED_IDS:
                self.cancelled.pop(next(iter(self.cancelled)))
            return request_id in self.migrated_to  # the handler forwards it to the peer
        if req.phase == "receiving":
            if req.receive_task is not None:
                req.receive_task.cancel()  # the receiver releases the reservation
            self.requests.pop(request_id, None)
            return True
        if request_id in self.in_step or req.migrating:
            self.doomed.add(request_id)  # freed after the step / the migration send
            return True
        self.finish(req)
        return True

    def take_migrated_peer(self, request_id: str) -> str | None:
        """The peer ``request_id`` was migrated to (forgotten here), or None."""
        return self.migrated_to.pop(request_id, None)

    # ------------------------------------------------------------ migration out
    async def freeze(self, request_id: str) -> DecodeRequest | None:
        """Take a runnable request out of the batch at a step boundary (for migration)."""
        req = self.requests.get(request_id)
        if req is None or req.phase != "runnable":
            return None
        req.migrating = True
        while request_id in self.in_step:
            await self.step_done.wait()
        return req if request_id in self.requests else None

    def unfreeze(self, req: DecodeRequest) -> None:
        req.migrating = False
        if req.request_id in self.doomed:
            self.doomed.discard(req.request_id)
            self.finish(req)
            return
        self.wakeup.set()

    def migrated(self, req: DecodeRequest, peer_id: str) -> None:
        """The peer installed the request: drop it here (no finish item: it goes on there)."""
        self.doomed.discard(req.request_id)
        self.migrated_to[req.request_id] = peer_id
        self.migrations_out_total += 1
        while len(self.migrated_to) > _MAX_REMEMBERED_IDS:  # bounded: oldest first
            self.migrated_to.pop(next(iter(self.migrated_to)))
        self.finish(req)

    def fail_frozen(self, req: DecodeRequest, error: str, code: str) -> None:
        """End a frozen request whose migration outcome is unknown: error item, blocks
        freed here, never resumed (the peer may hold it; migration.py cancels it there)."""
        self.doomed.discard(req.request_id)
        self.stream_error(req, error, code)
        self.finish(req)

    # ------------------------------------------------------------------ queries
    def drained(self) -> bool:
        """True when no request is held here (a D->P switch waits for it)."""
        return not self.requests

    def pending_prompt_tokens(self) -> int:
        """Prompt tokens accepted here (stolen suffixes, local prompts) not yet computed."""
        total = 0
        for req in self.requests.values():
            if req.phase == "receiving":
                total += len(req.suffix_token_ids)
            else:
                pending = req.seq.num_tokens - req.seq.num_cached_tokens
                total += pending if pending > 1 else 0
        return total

    @property
    def num_running(self) -> int:
        return len(self.runnable)

    @property
    def num_receiving(self) -> int:
        return len(self.requests) - len(self.runnable)
