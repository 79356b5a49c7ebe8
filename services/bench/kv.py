"""``fluidpd bench kv``: KV transfer bandwidth over UCX vs this machine's memcpy.

For each UCX transport setting (``UCX_TLS`` is process-wide, so each setting runs in a
fresh receiver process with a fresh sender process beside it), block size and payload:
end-to-end time from encoding the ticket until the blocks are installed on the receiver
(ticket, envelope, every segment, checksums on both sides, validation, install), with
validation on and off interleaved (same machine state); ``np.copyto`` over the same size,
between pre-faulted numpy buffers like the arena, timed right before and after every
transfer; CPU time of both processes per transfer; and the fixed per-transfer overhead of
a one-block transfer with its receiver- and sender-side breakdown. ``kv_zero_on_free``:
every transfer's blocks are also zeroed as that option does when they are freed, timed
apart; ``zero_overhead`` is that time over the transfer's (the hand-off with the option
on, over the same hand-off without it, minus one).
Last line: one JSON object; ``best_ratio`` is the best end-to-end (validation on)
bandwidth over memcpy bandwidth for payloads of 64 MiB and more (goal >= 0.6)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

MIB = 1 << 20
# Arena shape: 8 layers x (k, v) x 16 tokens x 2 heads x head_dim float32 = 2 KiB x head_dim.
_LAYERS, _HEADS, _BLOCK_TOKENS = 8, 2, 16
_MAX_BLOCKS_PER_TRANSFER = 16384


def _arena(num_blocks: int, block_kib: int, device: str = "cpu") -> Any:
    import torch

    from shared.engine.kv_arena import KVArena

    if device != "cpu":  # device memory, as a GPU worker's arena: UCX reads/writes it
        arena = KVArena(
            num_blocks, _LAYERS, _HEADS, block_kib // 2, _BLOCK_TOKENS, torch.float32, device
        )
        flat = arena.tensor.view(-1).view(torch.uint8)
        flat.copy_(
            torch.arange(flat.numel(), dtype=torch.int64, device=device).remainder_(251).byte()
        )
        torch.cuda.synchronize(device)
        return arena
    arena = KVArena(1, _LAYERS, _HEADS, block_kib // 2, _BLOCK_TOKENS, torch.float32)
    # Back the arena with transparent huge pages (numpy madvises large allocations; torch's
    # CPU allocator does not): UCX's shared-memory copy (CMA) pins pages one by one and
    # runs at ~9 GB/s on 4 KiB pages vs ~17 GB/s on 2 MiB pages on this host.
    shape = (num_blocks, *arena.tensor.shape[1:])
    backing = np.zeros(num_blocks * arena.block_nbytes, dtype=np.uint8)
    arena.tensor = torch.from_numpy(backing).view(torch.float32).view(shape)
    arena.num_blocks = num_blocks
    flat = arena.tensor.view(-1).view(torch.uint8)
    flat.copy_(torch.arange(flat.numel(), dtype=torch.int64).remainder_(251).to(torch.uint8))
    return arena


def _fingerprint(arena: Any) -> Any:
    from shared.transfer import KVFingerprint

    return KVFingerprint("bench", "w", "float32", _BLOCK_TOKENS, arena.layout)


SECRET = b"bench-secret-not-for-production"


# ------------------------------------------------------------------------ sender
async def _sender_main(device: str) -> None:
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
            arena = _arena(msg["num_blocks"], msg["block_kib"], msg.get("device", "cpu"))
            senders = {
                v: KVSender(
                    node,
                    worker_id="bench-src",
                    fingerprint=_fingerprint(arena),
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


# ------------------------------------------------------------------------ receiver
class _Memcpy:
    """``np.copyto`` between two buffers allocated like the arena (numpy, so 2 MiB pages
    where THP allows) and already faulted in, over the transfer's exact size. Timed right
    before and after every transfer: on a shared machine the baseline moves with the load.
    """

    def __init__(self, nbytes: int) -> None:
        self.src = np.full(nbytes, 7, dtype=np.uint8)
        self.dst = np.zeros(nbytes, dtype=np.uint8)
        np.copyto(self.dst, self.src)  # fault in the destination

    def seconds(self) -> float:
        t0 = time.perf_counter()
        np.copyto(self.dst, self.src)
        return time.perf_counter() - t0


class _DeviceCopy:
    """The memcpy baseline in device memory: ``dst.copy_(src)`` between two device
    buffers of the transfer's size, timed to completion (same role as ``_Memcpy``)."""

    def __init__(self, nbytes: int, device: str) -> None:
        import torch

        self._torch = torch
        self.device = device
        self.src = torch.full((nbytes,), 7, dtype=torch.uint8, device=device)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.seconds()

    def seconds(self) -> float:
        self._torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        self._torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0


class _Pair:
    """This process receives; a child process sends. Same UCX_TLS for both."""

    def __init__(self, node: Any, device: str) -> None:
        rfd, wfd = os.pipe()
        env = dict(os.environ, KV_BENCH_FD=str(wfd))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.bench.kv", "--role", "sender", "--device", device],
            stdin=subprocess.PIPE,
            text=True,
            env=env,
            pass_fds=(wfd,),
        )
        os.close(wfd)
        self.out = os.fdopen(rfd, "r")
        self.node = node
        self.sender_address = json.loads(self.out.readline())["address"]

    def call(self, **msg: Any) -> dict[str, Any]:
        self.post(**msg)
        return self.reply()

    def post(self, **msg: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict[str, Any]:
        reply: dict[str, Any] = json.loads(self.out.readline())
        return reply

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write('{"cmd": "exit"}\n')
        self.proc.stdin.flush()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:  # UCX teardown can hang (seen with UCX_TLS=tcp)
            self.proc.kill()
            self.proc.wait()


async def _one(pair: _Pair, receiver: Any, rid: str, num_tokens: int, validate: bool) -> dict:
    """One transfer, timed from encoding the ticket until the receiver installed.

    The ticket goes out from this thread (a pipe write that fits the pipe buffer): handing
    it to a helper thread made the measurement wait for the GIL behind the event loop.
    """
    loop = asyncio.get_running_loop()
    ticket = receiver.prepare(rid, num_tokens=num_tokens)
    recv = asyncio.create_task(receiver.receive(ticket, timeout_s=60))
    await asyncio.sleep(0)  # receives posted before the ticket leaves
    t0, cpu0 = time.perf_counter(), time.process_time()
    pair.post(cmd="send", ticket=receiver.encode_ticket(ticket).hex(), validate=validate)
    got = await recv
    e2e_s, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    sent = await loop.run_in_executor(None, pair.reply)
    # What kv_zero_on_free adds when these blocks are freed (BlockManager's zero_fn).
    t1 = time.perf_counter()
    receiver.arena.zero_blocks(receiver.bm.block_table(got.seq_id))
    zero_s = time.perf_counter() - t1
    receiver.bm.free_sequence(got.seq_id)
    return {
        "e2e_s": e2e_s,
        "zero_s": zero_s,
        "timings_ms": dict(got.timings_ms),
        "recv_cpu_ms": cpu_s * 1e3,
        "sender_ms": sent["timings_ms"],
        "transport": got.transport,
    }


def _overhead(one: list[dict[str, Any]]) -> dict[str, float]:
    """Medians (us) of one-block transfers: the fixed cost, nearly no copy time."""
    sender = {f"sender_{k}": [r["sender_ms"][k] for r in one] for k in one[0]["sender_ms"]}
    receiver = {k: [r["timings_ms"][k] for r in one] for k in one[0]["timings_ms"]}
    out = {
        "e2e_us_p50": statistics.median(r["e2e_s"] for r in one) * 1e6,
        "receiver_cpu_us_p50": round(statistics.median(r["recv_cpu_ms"] for r in one) * 1e3, 1),
    }
    for k, values in {**receiver, **sender}.items():
        out[k.replace("_ms", "_us_p50")] = round(statistics.median(values) * 1e3, 1)
    return out


def _row(
    tls: str, block_kib: int, payload_mib: int, validate: bool, runs: list[dict[str, Any]]
) -> dict[str, Any]:
    """One table row. ``ratio``: fastest transfer over fastest ``np.copyto``, both taken
    among the copies timed right around each transfer (best case vs best case, in the same
    window of machine load); ``ratio_p50``: median of the per-repetition ratios."""
    ratios = [r["memcpy_s"] / r["e2e_s"] for r in runs]
    best = min(runs, key=lambda r: r["e2e_s"])
    memcpy_s = min(r["memcpy_s"] for r in runs)
    nbytes = payload_mib * MIB
    return {
        "tls": tls,
        "block_kib": block_kib,
        "payload_mib": payload_mib,
        "validate": validate,
        "gbps": round(nbytes / best["e2e_s"] / 1e9, 2),
        "memcpy_gbps": round(nbytes / memcpy_s / 1e9, 2),
        "ratio": round(memcpy_s / best["e2e_s"], 3),
        "ratio_p50": round(statistics.median(ratios), 3),
        "envelope_wait_ms": round(best["timings_ms"]["envelope_wait_ms"], 2),
        "data_ms": round(best["timings_ms"]["data_ms"], 2),
        "validate_ms": round(best["timings_ms"]["validate_ms"], 2),
        "install_ms": round(best["timings_ms"]["install_ms"], 3),
        # Milestones of the best run, ms from the receive call (receiver) or send call.
        "marks_ms": {
            **{
                k: round(best["timings_ms"][f"{k}_ms"], 2)
                for k in ("segments_landed", "hashed")
                if f"{k}_ms" in best["timings_ms"]
            },
            **{
                f"sender_{k}": round(best["sender_ms"][f"{k}_ms"], 2)
                for k in ("envelope_posted", "trailer_posted", "data")
                if f"{k}_ms" in best["sender_ms"]
            },
        },
        "cpu_ms_receiver_p50": round(statistics.median(r["recv_cpu_ms"] for r in runs), 2),
        "cpu_ms_sender_p50": round(statistics.median(r["sender_ms"]["cpu_ms"] for r in runs), 2),
        "memcpy_ms_p50": round(statistics.median(r["memcpy_s"] for r in runs) * 1e3, 2),
        "zero_ms_p50": round(statistics.median(r["zero_s"] for r in runs) * 1e3, 2),
        "zero_overhead": round(statistics.median(r["zero_s"] / r["e2e_s"] for r in runs), 3),
        "transport": best["transport"],
    }


async def _pair_main(args: argparse.Namespace) -> dict[str, Any]:
    from shared.engine.block_manager import BlockManager
    from shared.transfer import KVReceiver, TransferNode
    from shared.transfer.ucx_node import TransferNodeConfig

    node = TransferNode(
        TransferNodeConfig(cuda_device=None if args.device == "cpu" else args.device)
    )
    await node.start()
    pair = _Pair(node, args.device)
    rows: list[dict[str, Any]] = []
    overhead: dict[str, Any] = {}
    for block_kib in args.block_kib:
        num_blocks = min(
            max(args.payload_mib) * MIB // (block_kib * 1024), _MAX_BLOCKS_PER_TRANSFER
        )
        arena = _arena(num_blocks, block_kib, args.device)
        pair.call(cmd="setup", num_blocks=num_blocks, block_kib=block_kib, device=args.device)
        bm = BlockManager(num_blocks, _BLOCK_TOKENS)  # one per arena, shared by both modes
        receivers = {
            v: KVReceiver(
                node,
                worker_id="bench-dst",
                block_manager=bm,
                arena=arena,
                fingerprint=_fingerprint(arena),
                secret=SECRET,
                verify_checksums=v,
            )
            for v in (True, False)
        }
        if block_kib == args.block_kib[0]:
            for validate in (True, False):
                one = [
                    await _one(
                        pair, receivers[validate], f"o{validate}{i}", _BLOCK_TOKENS, validate
                    )
                    for i in range(args.overhead_reps)
                ]
                overhead[str(validate)] = _overhead(one)
        for payload in args.payload_mib:
            if payload * MIB // (block_kib * 1024) > _MAX_BLOCKS_PER_TRANSFER:
                continue  # 1 GiB of 16 KiB blocks: per-block Python bookkeeping dominates
            tokens = payload * MIB // arena.block_nbytes * _BLOCK_TOKENS
            memcpy: Any = (
                _Memcpy(payload * MIB)
                if args.device == "cpu"
                else _DeviceCopy(payload * MIB, args.device)
            )
            runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
            reps = 2 if payload >= 1024 else args.reps
            for i in range(reps + 1):  # first round: warm-up
                for validate in (True, False):  # on and off in the same machine state
                    before = memcpy.seconds()
                    run = await _one(
                        pair,
                        receivers[validate],
                        f"p{block_kib}-{payload}-{validate}-{i}",
                        tokens,
                        validate,
                    )
                    run["memcpy_s"] = min(before, memcpy.seconds())
                    if i:
                        runs[validate].append(run)
            for validate in (True, False):
                rows.append(_row(args.tls[0], block_kib, payload, validate, runs[validate]))
                print(json.dumps(rows[-1]), file=sys.stderr)
            del memcpy
        del arena, receivers
    pair.close()
    return {"tls": args.tls[0], "device": args.device, "rows": rows, "overhead_us": overhead}


# ------------------------------------------------------------------------ driver
def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fluidpd bench kv", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="16 and 64 MiB, 64 KiB blocks")
    p.add_argument("--tls", action="append", help="UCX_TLS settings to try ('auto' = unset)")
    p.add_argument("--payload-mib", type=int, nargs="+", default=None)
    p.add_argument("--block-kib", type=int, nargs="+", default=None)
    p.add_argument(
        "--device",
        default="cpu",
        help="where both arenas live: cpu, or cuda[:N] (then the baseline is a device copy)",
    )
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--overhead-reps", type=int, default=30)
    p.add_argument(
        "--role", choices=["driver", "pair", "sender"], default="driver", help=argparse.SUPPRESS
    )
    args = p.parse_args(argv)
    if args.device != "cpu" and not args.device.startswith("cuda"):
        p.error(f"--device must be cpu or cuda[:N], got {args.device!r}")
    args.payload_mib = args.payload_mib or ([16, 64] if args.quick else [16, 64, 256, 1024])
    args.block_kib = args.block_kib or ([64] if args.quick else [16, 64, 256])
    args.tls = args.tls or (["auto"] if args.quick else ["auto", "sm,self", "tcp"])
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.role == "sender":
        asyncio.run(_sender_main(args.device))
        return 0
    if args.role == "pair":
        result = asyncio.run(_pair_main(args))
        print(json.dumps(result))
        return 0
    results, failed = [], []
    for tls in args.tls:
        env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n")
        env.pop("UCX_TLS", None)
        cmd_args = [
            "--tls",
            tls,
            "--reps",
            str(args.reps),
            "--overhead-reps",
            str(args.overhead_reps),
            "--device",
            args.device,
            "--payload-mib",
            *map(str, args.payload_mib),
            "--block-kib",
            *map(str, args.block_kib),
        ]
        if tls == "tcp":  # slow path (~1 GB/s): one block size, <= 256 MiB is enough
            cmd_args[cmd_args.index("--block-kib") + 1 :] = [str(max(args.block_kib))]
            small = [str(p) for p in args.payload_mib if p <= 256] or ["16"]
            i = cmd_args.index("--payload-mib") + 1
            cmd_args[i : cmd_args.index("--block-kib")] = small
        if tls != "auto":
            env["UCX_TLS"] = tls
        proc = subprocess.run(
            [sys.executable, "-m", "services.bench.kv", "--role", "pair", *cmd_args],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        sys.stderr.write(proc.stderr[-4000:] if proc.returncode else "")
        if proc.returncode:
            failed.append(tls)
            continue
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(res)
        for row in res["rows"]:
            print(
                f"tls={tls:8s} block={row['block_kib']:4d}KiB payload={row['payload_mib']:5d}MiB "
                f"validate={row['validate']!s:5s} {row['gbps']:6.2f} GB/s "
                f"memcpy {row['memcpy_gbps']:6.2f} ratio {row['ratio']:.2f} "
                f"zero-on-free +{row['zero_overhead']:.1%}"
            )
        print(f"tls={tls}: one-block overhead (us): {json.dumps(res['overhead_us'])}")
    rows = [r for res in results for r in res["rows"]]
    big = [r for r in rows if r["payload_mib"] >= 64]
    best_on = max((r for r in big if r["validate"]), key=lambda r: r["ratio"], default=None)
    best_off = max((r for r in big if not r["validate"]), key=lambda r: r["ratio"], default=None)
    zero = [r["zero_overhead"] for r in big if r["validate"]]
    summary = {
        "bench": "kv",
        # kv_zero_on_free: median over >= 64 MiB validated hand-offs of zeroing / transfer.
        "zero_on_free_overhead": round(statistics.median(zero), 3) if zero else None,
        "device": args.device,
        "best_ratio": best_on["ratio"] if best_on else None,
        "best": best_on,
        "best_ratio_no_validation": best_off["ratio"] if best_off else None,
        "goal_ratio": 0.6,
        "goal_met": bool(best_on and best_on["ratio"] >= 0.6),
        "overhead_us": {res["tls"]: res["overhead_us"] for res in results},
        "tls_failed": failed,
    }
    print(json.dumps(summary))
    return 0 if results else 1


if __name__ == "__main__":
    raise SystemExit(main())
