"""The sending process of ``fluidpd bench kv``: reads commands (setup, send) as JSON lines
on stdin, sends the arena's blocks to the ticket it is given, and answers each command with
one JSON line on the file descriptor ``KV_BENCH_FD`` (stdout stays free for logs)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

from services.bench.kv_setup import SECRET, bench_fingerprint, make_arena


async def sender_main(device: str) -> None:
    from shared.transfer import KVSender, TransferNode, TransferTicket
    from shared.transfer.ucx_node import TransferNodeConfig

    node = TransferNode(TransferNodeConfig(cuda_device=None if device == "cpu" else device))
    await node.start()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 26)  # tickets of 64k blocks are long lines
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = os.fdopen(int(os.environ["KV_BENCH_FD"]), "w", buffering=1)
    out.write(json.dumps({"address": node.address.hex()}) + "\n")
    arena: Any = None
    senders: dict[bool, KVSender] = {}
    while line := await reader.readline():
        msg = json.loads(line)
        if msg["cmd"] == "setup":
            arena = make_arena(msg["num_blocks"], msg["block_kib"], msg.get("device", "cpu"))
            senders = {
                v: KVSender(
                    node,
                    worker_id="bench-src",
                    fingerprint=bench_fingerprint(arena),
                    secret=SECRET,
                    send_checksums=v,
                )
                for v in (True, False)
            }
            out.write("{}\n")
        elif msg["cmd"] == "send":
            t_read = time.perf_counter()
            cpu0 = time.process_time()
            ticket = TransferTicket.decode(bytes.fromhex(msg["ticket"]), SECRET)
            res = await senders[msg["validate"]].send(
                ticket, arena, list(range(ticket.num_blocks)), timeout_s=60
            )
            timings = dict(
                res.timings_ms,
                wall_since_ticket_ms=(time.perf_counter() - t_read) * 1e3,
                cpu_ms=(time.process_time() - cpu0) * 1e3,
            )
            out.write(json.dumps({"timings_ms": timings}) + "\n")
        else:
            break
