"""Receiving side: reserve, receive straight into the arena, validate, install atomically.

``prepare`` reserves blocks and returns a sealed-able ticket for the sender; ``receive``
owns the reservation from then on and ends in exactly one of two ways:

- every segment arrived and the envelope, trailer, generations and checksums validated
  -> ``BlockManager.install`` in one step (the request becomes runnable), ok verdict sent;
  the deadline covers everything up to the verdict, not the verdict's send (the sender may
  act on it before the send completes here), so once the ok verdict is posted the receive
  succeeds (only a cancel by the caller, which ends the request, still frees it);
- anything else (rejection, sender abort, deadline, transport error, local cancellation)
  -> ``cancel_reservation`` (``free_sequence`` once installed: a failure while settling
  after the install); every posted UCX receive into the arena is cancelled and its pin
  (begin_receive) released only once UCX reports it complete, so a late write can never
  land in blocks that another request owns. Blocks are zeroed on free when the
  BlockManager was built with ``zero_fn=arena.zero_blocks`` (kv_zero_on_free).

Segments land directly in ``arena.run_bytes`` views: zero copies on this side, also when
the arena is CUDA memory (UCX writes device memory itself; checksums are computed on the
device with the algorithm the envelope names, shared/transfer/checksum.py).

What is checked before an install: receive_checks.py; how segments land and are checksummed:
segment_landing.py; how a failed receive lets go of its blocks: inbound.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.engine.block_manager import BlockManager
from shared.engine.kv_arena import KVArena
from shared.transfer import protocol as proto
from shared.transfer.envelope import (
    Envelope,
    KVFingerprint,
    TransferTicket,
    decode_abort,
    decode_trailer,
    encode_verdict,
)
from shared.transfer.errors import (
    TransferAborted,
    TransferError,
    TransferTimeout,
)
from shared.transfer.inbound import Inbound, InboundReleaser
from shared.transfer.receive_checks import check_envelope, check_landed
from shared.transfer.segment_landing import SegmentLanding
from shared.transfer.ucx_memory import bind_cuda_device
from shared.transfer.ucx_node import TransferNode

log = logging.getLogger(__name__)

_BACKGROUND_POLL_S = 0.002  # how often the (rare) sender abort is looked for


@dataclass(frozen=True)
class ReceivedKV:
    """An installed transfer: ``seq_id`` owns ``block_ids`` and is runnable."""

    request_id: str
    seq_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    meta: Mapping[str, Any]
    src_worker_id: str
    transport: str
    kv_bytes: int
    num_segments: int
    timings_ms: Mapping[str, float] = field(default_factory=dict)


class KVReceiver:
    """Receives KV for one worker into its arena, under its block manager."""

    def __init__(
        self,
        node: TransferNode,
        *,
        worker_id: str,
        block_manager: BlockManager,
        arena: KVArena,
        fingerprint: KVFingerprint,
        secret: bytes,
        verify_checksums: bool = True,
    ) -> None:
        if not secret:
            raise ValueError("a cluster secret is required")
        if block_manager.block_size != arena.block_size:
            raise ValueError("block manager and arena disagree on block_size")
        self.node = node
        self.worker_id = worker_id
        self.bm = block_manager
        self.arena = arena
        self.fingerprint_digest = fingerprint.digest()
        self._secret = secret
        self.verify_checksums = verify_checksums
        self._active: set[int] = set()
        self._landing = SegmentLanding(node, block_manager, arena)
        self._releaser = InboundReleaser(node, block_manager)
        bind_cuda_device(arena.tensor.device)  # this (the event loop's) thread posts receives

    def prepare(
        self, request_id: str, *, num_tokens: int, num_blocks: int | None = None
    ) -> TransferTicket:
        """Reserve blocks for ``num_tokens`` tokens (at least; ``num_blocks`` may add room
        to decode into) and return the ticket the sender needs.

        Raises NoFreeBlocksError (nothing changed). The caller must then call ``receive``
        or ``release`` with the ticket.
        """
        needed = self.bm.blocks_for_tokens(num_tokens)
        res = self.bm.reserve(request_id, max(needed, num_blocks or 0))
        tid = proto.new_transfer_id(self._active)
        self._active.add(tid)
        return TransferTicket(
            transfer_id=tid,
            request_id=request_id,
            dst_worker_id=self.worker_id,
            dst_address=self.node.address,
            dst_host_id=self.node.host_id,
            block_ids=res.block_ids,
            generations=res.generations,
            token_start=0,
            token_end=num_tokens,
            block_size=self.bm.block_size,
            block_nbytes=self.arena.block_nbytes,
        )

    def release(self, ticket: TransferTicket) -> None:
        """Give up a prepared ticket whose ``receive`` was never started."""
        self._active.discard(ticket.transfer_id)
        self.bm.cancel_reservation(ticket.request_id)

    def encode_ticket(self, ticket: TransferTicket) -> bytes:
        return ticket.encode(self._secret)

    async def receive(
        self, ticket: TransferTicket, *, timeout_s: float, seq_id: str | None = None
    ) -> ReceivedKV:
        """Wait for the transfer of ``ticket`` and install it as ``seq_id`` (default: the
        request id). Raises TransferRejected / TransferAborted / TransferTimeout /
        TransportError; on any exception the reservation is released as described above.
        """
        st = Inbound(ticket)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        error: TransferError | None = None
        seq = seq_id or ticket.request_id
        try:
            async with asyncio.timeout(timeout_s):
                got = await self._receive(st, seq, t0)
        except TimeoutError:
            n_seg = len(st.envelope.segments) if st.envelope else 0
            error = TransferTimeout(
                f"receiver deadline exceeded ({st.segments_done}/{n_seg} segments)",
                request_id=ticket.request_id,
            )
            raise error from None
        except TransferError as exc:
            error = exc
            raise
        except asyncio.CancelledError:
            error = TransferAborted("cancelled by receiver", request_id=ticket.request_id)
            raise
        except Exception as exc:  # a bug or a BlockStateError: still free everything
            error = TransferError(
                f"internal error {type(exc).__name__}", request_id=ticket.request_id
            )
            raise
        finally:
            st.hash_stop.set()  # the hash thread must not wait for receives never coming
            if error is not None:
                # Shielded: a second cancel (the caller's and our deadline's can coincide)
                # must not abandon the clean-up halfway and leave the reservation held.
                await asyncio.shield(self._fail(st, error))
            self._active.discard(ticket.transfer_id)
        # Committed: landed, validated, installed, control receives settled. The sender
        # drops its copy once the "installed" verdict reaches it, which can be before the
        # send completes here, so no deadline applies from this point: one firing mid-send
        # freed blocks the sender counted as moved, and a migrated request ended silently.
        # The send is bounded by its own timeout. A cancel by our caller still frees the
        # sequence (it ended the request here: a client cancel, an engine failure).
        assert st.envelope is not None  # installed: the envelope was read and checked
        try:
            await self._send_verdict(st.envelope, True, "installed")
        except BaseException:
            self.bm.free_sequence(seq)
            raise
        return got

    # ------------------------------------------------------------------ internals
    async def _receive(self, st: Inbound, seq_id: str, t0: float) -> ReceivedKV:
        """Land, validate and install ``st``'s transfer as ``seq_id`` (sets ``st.envelope``);
        the ok verdict is the caller's (``receive``, outside the deadline). On any exception
        after the install the sequence is freed again."""
        ticket, node, loop = st.ticket, self.node, asyncio.get_running_loop()
        tid, n = ticket.transfer_id, ticket.num_blocks
        dst = ticket.block_ids[:n]
        env_buf = bytearray(proto.envelope_capacity(n))
        abort_buf = bytearray(proto.CONTROL_CAPACITY)
        env_req = node.post_recv(env_buf, proto.tag(tid, proto.ENVELOPE_TAG))
        abort_req = node.post_recv(abort_buf, proto.tag(tid, proto.ABORT_TAG))
        st.control += [env_req, abort_req]
        abort_task = asyncio.create_task(node.wait(abort_req, poll_s=_BACKGROUND_POLL_S))
        env_task = asyncio.create_task(node.wait(env_req))
        st.tasks += [abort_task, env_task]
        await self._race(st, env_task, abort_task, abort_buf)
        env, env_mac = Envelope.decode(env_buf, self._secret)
        st.envelope = env
        check_envelope(
            ticket,
            env,
            dst,
            worker_id=self.worker_id,
            fingerprint_digest=self.fingerprint_digest,
            block_nbytes=self.arena.block_nbytes,
            verify_checksums=self.verify_checksums,
        )
        t_env = loop.time()

        trailer_buf = bytearray(proto.trailer_capacity(n))
        trailer_req = node.post_recv(trailer_buf, proto.tag(tid, proto.TRAILER_TAG))
        st.control.append(trailer_req)
        collect = asyncio.create_task(
            self._landing.collect(st, dst, trailer_req, verify_checksums=self.verify_checksums)
        )
        st.tasks.append(collect)
        await self._race(st, collect, abort_task, abort_buf)
        got = collect.result()
        t_data = loop.time()

        expected = decode_trailer(trailer_buf, tid, env_mac, self._secret)
        check_landed(
            ticket.request_id,
            expected,
            got if self.verify_checksums else None,
            env.generations,
            self.bm.generations(dst),
        )
        t_valid = loop.time()
        # Every segment receive is complete: drop the pins, then install in one step.
        for _ in st.pinned:
            self.bm.end_receive(ticket.request_id)
        st.pinned.clear()
        block_ids = self.bm.install(ticket.request_id, ticket.token_end, seq_id)
        t_inst = loop.time()
        abort_task.cancel()
        try:
            await self._releaser.settle_control(st)
        except BaseException:
            # Failed (or cancelled, or past the deadline) before the caller got the
            # sequence: nobody would ever run or free it, so free it here; the caller sees
            # the error and ``receive`` reports it to the sender (no ok verdict went out).
            self.bm.free_sequence(seq_id)
            raise
        timings = {
            "envelope_wait_ms": (t_env - t0) * 1e3,
            "data_ms": (t_data - t_env) * 1e3,
            **{f"{k}_ms": (t - t0) * 1e3 for k, t in st.marks.items()},
            "validate_ms": (t_valid - t_data) * 1e3,
            "install_ms": (t_inst - t_valid) * 1e3,
            "total_ms": (loop.time() - t0) * 1e3,
        }
        log.info(
            "kv installed request=%s transfer=%x blocks=%d bytes=%d segments=%d src=%s ms=%.2f",
            ticket.request_id,
            tid,
            n,
            n * self.arena.block_nbytes,
            len(env.segments),
            env.src_worker_id,
            timings["total_ms"],
        )
        return ReceivedKV(
            request_id=ticket.request_id,
            seq_id=seq_id,
            block_ids=block_ids,
            num_tokens=ticket.token_end,
            meta=dict(env.meta),
            src_worker_id=env.src_worker_id,
            transport=node.transport_label(env.src_host_id),
            kv_bytes=n * self.arena.block_nbytes,
            num_segments=len(env.segments),
            timings_ms=timings,
        )

    async def _race(
        self, st: Inbound, work: Any, abort_task: asyncio.Future[Any], abort_buf: bytearray
    ) -> None:
        """Await ``work`` unless the sender's abort arrives first (then raise)."""
        work_f = asyncio.ensure_future(work)
        # Whatever happens to us (deadline), its outcome is consumed: no "never retrieved".
        work_f.add_done_callback(lambda f: f.cancelled() or f.exception())
        done, _ = await asyncio.wait({work_f, abort_task}, return_when=asyncio.FIRST_COMPLETED)
        if work_f in done:
            work_f.result()
            return
        work_f.cancel()
        with contextlib.suppress(BaseException):
            await work_f
        abort_task.result()
        st.sender_aborted = True
        reason = decode_abort(abort_buf, st.ticket.transfer_id, self._secret)
        raise TransferAborted(
            f"sender aborted: {reason}", request_id=st.ticket.request_id, retryable=True
        )

    async def _fail(self, st: Inbound, error: TransferError) -> None:
        await self._releaser.release(st)
        log.warning(
            "kv receive failed request=%s transfer=%x error=%s segments_done=%d",
            st.ticket.request_id,
            st.ticket.transfer_id,
            error.code,
            st.segments_done,
        )
        if st.envelope is not None and not st.sender_aborted:
            await self._send_verdict(st.envelope, False, error.reason)

    async def _send_verdict(self, env: Envelope, ok: bool, reason: str) -> None:
        """Best effort and bounded: the sender has its own deadline."""
        try:
            ep = await self.node.endpoint(env.src_address, env.src_host_id)
            frame = encode_verdict(env.transfer_id, ok, reason, self._secret)
            await self.node.send_control(
                ep, frame, proto.tag(env.transfer_id, proto.VERDICT_TAG), timeout_s=1.0
            )
        except Exception:
            log.warning("kv verdict not sent transfer=%x", env.transfer_id)

    def close(self) -> None:
        self._landing.close()
