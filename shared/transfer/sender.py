"""Sending side: move the blocks named by a ticket straight into the receiver's arena.

Used for both prefill -> decode hand-off and live migration of a running decode request
(the caller passes its arena, the sequence's block table and the ticket; it must keep the
sequence from growing or being freed until ``on_source_released`` has been called).

Message order: sealed envelope, then one message per segment (a run contiguous on both
sides, sent from a contiguous view of our arena: zero copies on this side), then the
sealed checksum trailer. Checksums of segment k+1 are computed (in a worker thread,
xxhash and torch release the GIL) while segment k is on the wire. Then we wait for the
receiver's sealed verdict.

Device-agnostic: segments are views of the arena wherever it lives. A CUDA arena is sent
straight from device memory (ucxx takes ``__cuda_array_interface__``; UCX moves it with
cuda_ipc/cuda_copy on one host) and hashed on the device (checksum.fold64): no host copy.
The caller's contract: the blocks' writes have finished. The engine guarantees it: every
forward ends in sampling on the host, which waits for the stream the KV was written on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from shared.engine.kv_arena import KVArena
from shared.transfer import protocol as proto
from shared.transfer.checksum import ALGORITHMS, BlockHasher, algorithm_for
from shared.transfer.envelope import (
    Envelope,
    KVFingerprint,
    TransferTicket,
    decode_verdict,
    encode_abort,
    encode_trailer,
)
from shared.transfer.errors import TransferError, TransferRejected, TransferTimeout
from shared.transfer.ucx_memory import bind_cuda_device
from shared.transfer.ucx_node import TransferNode

log = logging.getLogger(__name__)

_INLINE_HASH_BYTES = 1 << 20
_SEND_POLL_S = 0.002  # safety re-check of an event-driven wait (TransferNode.wait)


@dataclass(frozen=True)
class SendOutcome:
    """The receiver installed the blocks: ownership moved, the source may be freed."""

    request_id: str
    transfer_id: int
    num_blocks: int
    kv_bytes: int
    num_segments: int
    transport: str
    timings_ms: Mapping[str, float] = field(default_factory=dict)


SegmentReady = Callable[[int, int], Awaitable[None]]


class KVSender:
    """Sends KV blocks for one worker. Stateless between calls apart from the hash thread."""

    def __init__(
        self,
        node: TransferNode,
        *,
        worker_id: str,
        fingerprint: KVFingerprint,
        secret: bytes,
        send_checksums: bool = True,
        max_segment_bytes: int = 8 << 20,
        checksum_algorithm: str | None = None,
    ) -> None:
        """``max_segment_bytes`` caps one message so the receiver can checksum segment k
        while k+1 is still being copied (a whole-run message would serialise the two).
        ``checksum_algorithm``: one of checksum.ALGORITHMS; None picks by the arena's
        device (``algorithm_for``). Raises ValueError on bad arguments."""
        if not secret:
            raise ValueError("a cluster secret is required")
        if checksum_algorithm is not None and checksum_algorithm not in ALGORITHMS:
            raise ValueError(f"unknown checksum algorithm {checksum_algorithm!r}")
        self.checksum_algorithm = checksum_algorithm
        if max_segment_bytes <= 0:
            raise ValueError("max_segment_bytes must be > 0")
        self.max_segment_bytes = max_segment_bytes
        self.node = node
        self.worker_id = worker_id
        self.fingerprint_digest = fingerprint.digest()
        self._secret = secret
        self.send_checksums = send_checksums
        self._hash_pool = ThreadPoolExecutor(1, thread_name_prefix="kv-send-hash")
        self._hashers: dict[tuple[str, int], BlockHasher] = {}  # (device, block_nbytes)

    async def send(
        self,
        ticket: TransferTicket,
        arena: KVArena,
        src_block_ids: Sequence[int],
        *,
        timeout_s: float,
        meta: Mapping[str, Any] | None = None,
        checksums: Sequence[int] | None = None,
        segment_ready: SegmentReady | None = None,
        on_source_released: Callable[[], None] | None = None,
    ) -> SendOutcome:
        """Send blocks ``src_block_ids`` (logical order) for ``ticket``'s token range.

        Does not mutate the arena. ``checksums``: per-block checksums the caller already
        has, of this sender's algorithm (``checksum_algorithm``, else the arena device's;
        computed on the fly otherwise). ``segment_ready(first, count)`` is awaited before a
        segment is sent (stream blocks as they are computed; tests pause here).
        ``on_source_released`` is called exactly once, as soon as no UCX operation reads
        the source blocks any more (success or failure).

        Returns SendOutcome once the receiver installed. Raises TransferRejected (receiver
        said no, retryable), TransferTimeout (retryable only if our last message was not
        yet posted), TransportError, ValueError (arguments inconsistent with the ticket).
        """
        n = ticket.num_blocks
        if len(src_block_ids) != n:
            raise ValueError(f"ticket needs {n} blocks, got {len(src_block_ids)}")
        if arena.block_nbytes != ticket.block_nbytes or arena.block_size != ticket.block_size:
            raise TransferRejected(
                "KV block layout differs from the receiver's", request_id=ticket.request_id
            )
        if checksums is not None and len(checksums) != n:
            raise ValueError("one checksum per block required")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        tid = ticket.transfer_id
        max_blocks = max(1, self.max_segment_bytes // arena.block_nbytes)
        segments = proto.plan_segments(src_block_ids, ticket.block_ids[:n], max_blocks)
        hasher = self._hasher(arena)
        envelope = Envelope(
            transfer_id=tid,
            request_id=ticket.request_id,
            fingerprint_digest=self.fingerprint_digest,
            token_start=ticket.token_start,
            token_end=ticket.token_end,
            num_blocks=n,
            block_nbytes=arena.block_nbytes,
            generations=ticket.generations[:n],
            segments=tuple(segments),
            src_worker_id=self.worker_id,
            dst_worker_id=ticket.dst_worker_id,
            src_address=self.node.address,
            src_host_id=self.node.host_id,
            has_checksums=self.send_checksums,
            meta=dict(meta or {}),
            checksum_algorithm=hasher.algorithm,
        )
        env_frame, env_mac = envelope.encode(self._secret)
        posted: list[Any] = []
        state = {"last_posted": False, "verdict": False, "released": False}
        timings: dict[str, float] = {}

        def release() -> None:
            if not state["released"]:
                state["released"] = True
                if on_source_released is not None:
                    on_source_released()

        async def pump(ep: Any) -> None:
            posted.append(self.node.post_send(ep, bytearray(env_frame), proto.tag(tid, 0)))
            timings["envelope_posted_ms"] = (loop.time() - t0) * 1e3
            sums: list[int] = list(checksums) if checksums is not None else []
            hashes: list[asyncio.Future[list[int]]] = []
            for k, (first, count) in enumerate(segments):
                if segment_ready is not None:
                    await segment_ready(first, count)
                view = arena.run_bytes(src_block_ids[first], count)
                posted.append(self.node.post_send(ep, view, proto.segment_tag(tid, k)))
                if self.send_checksums and checksums is None:
                    # Hash what is already on the wire: the source does not change while
                    # the receiver copies it, so the trailer is ready soon after the data.
                    hashes.append(self._hash(hasher, view))
            for fut in hashes:
                sums.extend(await fut)
            trailer = encode_trailer(
                tid, env_mac, sums if self.send_checksums else [], self._secret
            )
            posted.append(
                self.node.post_send(ep, bytearray(trailer), proto.tag(tid, proto.TRAILER_TAG))
            )
            state["last_posted"] = True
            timings["trailer_posted_ms"] = (loop.time() - t0) * 1e3
            for req in posted:
                # Event-driven (see TransferNode.wait): the receiver drives the copy (CMA
                # get); this side only learns of completions and must not take a core.
                await self.node.wait(req, poll_s=_SEND_POLL_S)
            timings["data_ms"] = (loop.time() - t0) * 1e3

        verdict_buf = bytearray(proto.CONTROL_CAPACITY)
        verdict_req = self.node.post_recv(verdict_buf, proto.tag(tid, proto.VERDICT_TAG))
        pump_task: asyncio.Task[None] | None = None
        ep: Any = None
        failure = "cancelled by sender"
        try:
            async with asyncio.timeout(timeout_s):
                ep = await self.node.endpoint(ticket.dst_address, ticket.dst_host_id)
                pump_task = asyncio.create_task(pump(ep))
                # While data flows the pump is the one hot waiter; an early verdict (a
                # rejection) is polled for in the background.
                early = asyncio.create_task(self.node.wait(verdict_req, poll_s=0.002))
                try:
                    done, _ = await asyncio.wait(
                        {pump_task, early}, return_when=asyncio.FIRST_COMPLETED
                    )
                    if pump_task in done:
                        pump_task.result()
                        release()
                    early.cancel()
                    await self.node.wait(verdict_req)
                finally:
                    early.cancel()
            state["verdict"] = True
            ok, reason = decode_verdict(verdict_buf, tid, self._secret)
            if not ok:
                raise TransferRejected(reason, request_id=ticket.request_id, retryable=True)
        except TimeoutError:
            failure = "sender deadline exceeded"
            raise TransferTimeout(
                failure, request_id=ticket.request_id, retryable=not state["last_posted"]
            ) from None
        except TransferError as exc:
            failure = exc.reason
            raise
        finally:
            if pump_task is not None and not pump_task.done():
                pump_task.cancel()
                with contextlib.suppress(BaseException):
                    await pump_task
            if not state["verdict"]:
                await self._abort(ep, tid, failure)
            for req in [*posted, verdict_req]:
                # A send the receiver never matches stays posted (UCX cannot cancel a
                # send); a stopped receiver may still match it later, so its buffer (the
                # envelope/trailer frames) must outlive this call: the node holds it.
                await self.node.let_go(req)
            release()
        timings["total_ms"] = (loop.time() - t0) * 1e3
        log.info(
            "kv sent request=%s transfer=%x blocks=%d bytes=%d segments=%d dst=%s ms=%.2f",
            ticket.request_id,
            tid,
            n,
            n * arena.block_nbytes,
            len(segments),
            ticket.dst_worker_id,
            timings["total_ms"],
        )
        return SendOutcome(
            request_id=ticket.request_id,
            transfer_id=tid,
            num_blocks=n,
            kv_bytes=n * arena.block_nbytes,
            num_segments=len(segments),
            transport=self.node.transport_label(ticket.dst_host_id),
            timings_ms=timings,
        )

    def _hasher(self, arena: KVArena) -> BlockHasher:
        """The checksum of this arena's device (one hasher, and CUDA stream, per arena)."""
        device = arena.tensor.device
        key = (str(device), arena.block_nbytes)
        if key not in self._hashers:
            bind_cuda_device(device)  # once per arena: this (the loop's) thread posts sends
            algorithm = self.checksum_algorithm or algorithm_for(device)
            self._hashers[key] = BlockHasher(algorithm, arena.block_nbytes, device)
        return self._hashers[key]

    def _hash(self, hasher: BlockHasher, run: Any) -> asyncio.Future[list[int]]:
        """Checksums of ``run``: inline when small on CPU, else queued on the hash thread
        (on CUDA always: the hash waits for its kernels, which must not hold the loop)."""
        loop = asyncio.get_running_loop()
        if run.device.type == "cpu" and run.numel() < _INLINE_HASH_BYTES:
            fut: asyncio.Future[list[int]] = loop.create_future()
            fut.set_result(hasher(run))
            return fut
        return loop.run_in_executor(self._hash_pool, hasher, run)

    async def _abort(self, ep: Any, transfer_id: int, reason: str) -> None:
        """Best effort: tell the receiver to free its reservation now."""
        if ep is None:
            return
        try:
            frame = encode_abort(transfer_id, reason, self._secret)
            await self.node.send_control(ep, frame, proto.tag(transfer_id, proto.ABORT_TAG), 0.2)
        except Exception:
            log.warning("kv abort not sent transfer=%x", transfer_id)

    def close(self) -> None:
        self._hash_pool.shutdown(wait=False)
