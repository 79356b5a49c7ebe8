"""A worker-like process for transfer tests: one TransferNode, one arena, one BlockManager.

Driven by JSON lines on stdin (``{"id": n, "cmd": ..., ...}``); answers JSON lines on
stdout (``{"id": n, "ok": bool, ...}``), plus unsolicited ``{"event": ...}`` lines. Commands
run as concurrent asyncio tasks, so many transfers can be in flight at once.

Usage: python tests/support/transfer_peer.py WORKER_ID SECRET_HEX [NUM_BLOCKS]
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from shared.engine.block_manager import BlockManager
from shared.engine.kv_arena import KVArena
from shared.transfer import (
    KVFingerprint,
    KVReceiver,
    KVSender,
    TransferError,
    TransferNode,
    TransferTicket,
    block_checksums,
)
from shared.transfer.checksum import XXH3
from shared.transfer.ucx_node import TransferNodeConfig

BLOCK_SIZE = 16


def fingerprint(arena: KVArena, weights: str = "w0") -> KVFingerprint:
    return KVFingerprint(
        arch_digest="tiny-llama",
        weight_digest=weights,
        dtype="float32",
        block_size=BLOCK_SIZE,
        kv_layout=arena.layout,
        rope_params="theta=10000",
        tokenizer_digest="tok0",
    )


class Peer:
    def __init__(self, worker_id: str, secret: bytes, num_blocks: int, device: str = "cpu") -> None:
        self.worker_id = worker_id
        self.secret = secret
        self.arena = KVArena(num_blocks, 2, 2, 32, BLOCK_SIZE, device=device)
        self.bm = BlockManager(num_blocks, BLOCK_SIZE, zero_fn=self.arena.zero_blocks)
        self.node = TransferNode(
            TransferNodeConfig(cuda_device=None if device == "cpu" else device)
        )
        self.tickets: dict[str, TransferTicket] = {}
        self.resume: dict[str, asyncio.Event] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self.node.start()
        self.receiver = KVReceiver(
            self.node,
            worker_id=self.worker_id,
            block_manager=self.bm,
            arena=self.arena,
            fingerprint=fingerprint(self.arena),
            secret=self.secret,
        )
        self.sender = KVSender(
            self.node,
            worker_id=self.worker_id,
            fingerprint=fingerprint(self.arena),
            secret=self.secret,
        )

    def emit(self, obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    def digests(self, block_ids: Any) -> list[str]:
        return [
            hashlib.blake2b(
                self.arena.block_bytes(b).cpu().numpy().tobytes(), digest_size=8
            ).hexdigest()
            for b in block_ids
        ]

    def fill(self, seq: str, block_ids: Any, seed: int) -> None:
        gen = random.Random(seed)
        for b in block_ids:
            view = self.arena.block_bytes(b)
            data = np.frombuffer(gen.randbytes(view.numel()), dtype=np.uint8).copy()
            view.copy_(torch.from_numpy(data))  # host -> wherever the arena lives

    # ------------------------------------------------------------------ commands
    async def cmd_fill(self, seq: str, num_tokens: int, seed: int) -> dict[str, Any]:
        ids = self.bm.allocate(seq, num_tokens)
        self.fill(seq, ids, seed)
        return {"block_ids": list(ids), "digests": self.digests(ids)}

    async def cmd_fill_all(self, seq: str, seed: int) -> dict[str, Any]:
        return await self.cmd_fill(seq, self.bm.num_free_blocks * BLOCK_SIZE, seed)

    async def cmd_fragment(self, seed: int) -> dict[str, Any]:
        """Allocate small sequences and free them in random order: a scattered free list."""
        gen = random.Random(seed)
        names = []
        for i in range(gen.randint(2, 8)):
            tokens = gen.randint(1, 4) * BLOCK_SIZE
            if self.bm.can_allocate(self.bm.blocks_for_tokens(tokens)):
                self.bm.allocate(f"frag-{seed}-{i}", tokens)
                names.append(f"frag-{seed}-{i}")
        gen.shuffle(names)
        for name in names:
            self.bm.free_sequence(name)
        return {}

    async def cmd_scatter(self) -> dict[str, Any]:
        """Reorder the free list to descending ids: every later reservation is scattered."""
        names = [f"scatter-{b}" for b in range(self.bm.num_free_blocks)]
        for name in names:
            self.bm.allocate(name, BLOCK_SIZE)
        for name in sorted(names, key=lambda n: -self.bm.block_table(n)[0]):
            self.bm.free_sequence(name)
        return {}

    async def cmd_late_write(self, ticket: str, seq: str) -> dict[str, Any]:
        """A misbehaving late sender: push block bytes on a (cancelled) ticket's data tags."""
        from shared.transfer import protocol as proto

        tk = TransferTicket.decode(bytes.fromhex(ticket), self.secret)
        ep = await self.node.endpoint(tk.dst_address, tk.dst_host_id)
        src = self.bm.block_table(seq)
        ops = [
            self.node.post_send(ep, self.arena.block_bytes(b), proto.segment_tag(tk.transfer_id, k))
            for k, b in enumerate(src[: tk.num_blocks])
        ]
        await asyncio.sleep(0.3)
        matched = sum(op.completed for op in ops)
        for op in ops:
            await self.node.settle(op, grace_s=0.05)
        return {"posted": len(ops), "matched": matched}

    async def cmd_fail_settle(self, mode: str) -> dict[str, Any]:
        """Fault the receiver's next settle of its control receives — in a receive that
        validates, the one right after ``BlockManager.install``: ``raise`` makes it raise
        (a transport fault), ``hang`` makes it wait past the receive's deadline. Later
        settles (the release path's) run normally."""
        releaser = self.receiver._releaser

        async def faulty(st: Any) -> None:
            del releaser.settle_control  # one shot: the class's method again
            if mode == "hang":
                await asyncio.Event().wait()
            raise TransferError("settle failed (fault injected by the test)")

        releaser.settle_control = faulty  # type: ignore[method-assign]
        return {}

    async def cmd_slow_verdict(self, hold_s: float) -> dict[str, Any]:
        """Make the receiver's next verdict send complete ``hold_s`` late: the frame goes
        out at once (the sender has it), then the send waits, as a slow completion would."""
        receiver = self.receiver

        async def slow(env: Any, ok: bool, reason: str) -> None:
            del receiver._send_verdict  # one shot: the class's method again
            await receiver._send_verdict(env, ok, reason)
            await asyncio.sleep(hold_s)

        receiver._send_verdict = slow  # type: ignore[method-assign]
        return {}

    async def cmd_digests(self, seq: str) -> dict[str, Any]:
        ids = self.bm.block_table(seq)
        return {"block_ids": list(ids), "digests": self.digests(ids)}

    async def cmd_free(self, seq: str) -> dict[str, Any]:
        self.bm.free_sequence(seq)
        return {}

    async def cmd_prepare(
        self, request_id: str, num_tokens: int, num_blocks: int | None = None
    ) -> dict[str, Any]:
        ticket = self.receiver.prepare(request_id, num_tokens=num_tokens, num_blocks=num_blocks)
        self.tickets[request_id] = ticket
        return {
            "ticket": self.receiver.encode_ticket(ticket).hex(),
            "block_ids": list(ticket.block_ids),
        }

    async def cmd_receive(self, request_id: str, timeout_s: float) -> dict[str, Any]:
        ticket = self.tickets.pop(request_id)
        got = await self.receiver.receive(ticket, timeout_s=timeout_s)
        return {
            "seq_id": got.seq_id,
            "block_ids": list(got.block_ids),
            "digests": self.digests(got.block_ids[: ticket.num_blocks]),
            "meta": dict(got.meta),
            "transport": got.transport,
            "timings_ms": dict(got.timings_ms),
        }

    async def cmd_send(
        self,
        ticket: str,
        seq: str,
        timeout_s: float,
        meta: Any = None,
        secret: str | None = None,
        weights: str | None = None,
        corrupt_block: int | None = None,
        stall_after: int | None = None,
        free_on_release: bool = True,
        checksum_algorithm: str | None = None,
    ) -> dict[str, Any]:
        tk = TransferTicket.decode(bytes.fromhex(ticket), self.secret)
        sender = self.sender
        if secret is not None or weights is not None or checksum_algorithm is not None:
            sender = KVSender(
                self.node,
                worker_id=self.worker_id,
                fingerprint=fingerprint(self.arena, weights or "w0"),
                secret=bytes.fromhex(secret) if secret else self.secret,
                checksum_algorithm=checksum_algorithm,
            )
        src = self.bm.block_table(seq)[: tk.num_blocks]
        sums = None
        if corrupt_block is not None:  # right checksums, wrong bytes: a flipped bit in flight
            sums = [
                block_checksums(
                    self.arena.block_bytes(b),
                    self.arena.block_nbytes,
                    checksum_algorithm or XXH3,
                )[0]
                for b in src
            ]
            self.arena.block_bytes(src[corrupt_block])[7] ^= 0x10
        released = asyncio.Event()
        resume = self.resume.setdefault(tk.request_id, asyncio.Event())

        async def segment_ready(first: int, count: int) -> None:
            if stall_after is not None and first >= stall_after:
                self.emit({"event": "stalled", "request_id": tk.request_id})
                await resume.wait()

        def on_release() -> None:
            released.set()
            if free_on_release:
                self.bm.free_sequence(seq)

        outcome = await sender.send(
            tk,
            self.arena,
            src,
            timeout_s=timeout_s,
            meta=meta,
            checksums=sums,
            segment_ready=segment_ready,
            on_source_released=on_release,
        )
        return {
            "released": released.is_set(),
            "transport": outcome.transport,
            "segments": outcome.num_segments,
            "timings_ms": dict(outcome.timings_ms),
        }

    async def cmd_resume(self, request_id: str) -> dict[str, Any]:
        self.resume.setdefault(request_id, asyncio.Event()).set()
        return {}

    async def cmd_state(self) -> dict[str, Any]:
        try:
            self.bm.check_integrity()
            integrity = "ok"
        except AssertionError as exc:
            integrity = f"broken: {exc}"
        return {
            "free_blocks": self.bm.num_free_blocks,
            "num_blocks": self.bm.num_blocks,
            "reservations": list(self.bm.reservations()),
            "sequences": list(self.bm.sequences()),
            "integrity": integrity,
            "vetoed": self.node.peer_copy_failures_vetoed,
        }

    # ------------------------------------------------------------------ plumbing
    async def run_one(self, msg: dict[str, Any]) -> None:
        rid = msg.pop("id")
        handler = getattr(self, "cmd_" + msg.pop("cmd"))
        try:
            result = await handler(**msg)
            self.emit({"id": rid, "ok": True, **result})
        except TransferError as exc:
            self.emit(
                {
                    "id": rid,
                    "ok": False,
                    "error": exc.code,
                    "reason": exc.reason,
                    "retryable": exc.retryable,
                }
            )
        except Exception as exc:
            self.emit({"id": rid, "ok": False, "error": type(exc).__name__, "reason": str(exc)})

    async def serve(self) -> None:
        await self.start()
        self.emit(
            {
                "event": "ready",
                "address": self.node.address.hex(),
                "pid": os.getpid(),
                "can_cancel": self.node.can_cancel,
                "peer_guard": self.node.peer_guard_installed,
            }
        )
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            msg = json.loads(line)
            if msg.get("cmd") == "exit":
                break
            task = asyncio.create_task(self.run_one(msg))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        await self.node.close()


def main() -> None:
    # UCX writes its own log lines to stdout: keep fd 1 for them (pointed at stderr) and
    # speak JSON on a private duplicate of the original stdout.
    json_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(json_fd, "w", buffering=1)
    logging.basicConfig(level=os.environ.get("PEER_LOG", "WARNING"), stream=sys.stderr)
    num_blocks = int(sys.argv[3]) if len(sys.argv) > 3 else 256
    device = sys.argv[4] if len(sys.argv) > 4 else "cpu"  # cuda: the arena in GPU memory
    asyncio.run(Peer(sys.argv[1], bytes.fromhex(sys.argv[2]), num_blocks, device).serve())


if __name__ == "__main__":
    main()
