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
bandwidth over memcpy bandwidth for payloads of 64 MiB and more (goal >= 0.6).

Three processes, each its own file: this driver (one receiving process per UCX_TLS
setting), the receiving and timing side (kv_pair.py), the sender beside it (kv_sender.py);
what both ends share is kv_setup.py."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys

from services.bench.kv_pair import pair_main
from services.bench.kv_sender import sender_main


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
        asyncio.run(sender_main(args.device))
        return 0
    if args.role == "pair":
        result = asyncio.run(pair_main(args))
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
