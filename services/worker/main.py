"""Command line of a worker process (both roles): flags and env -> WorkerConfig -> run."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from typing import cast

from services.common.bus_flags import add_bus_flags, bus_config_from_args
from services.common.logging import configure_logging
from services.common.service import announce_ready
from services.worker.config import WorkerConfig, default_worker_id
from shared.aio import run
from shared.engine.defaults import DEFAULT_KV_CACHE_BYTES
from shared.errors import FluidPDError
from shared.policy.admission import DEFAULT_EXPIRE_MARGIN_S
from shared.policy.roles import PREFILL, Role


def build_parser(role: str) -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog=f"python -m services.{role}_worker",
        description=f"FluidPD worker, starting in the {role} role",
    )
    p.add_argument("--id", default=env("FLUIDPD_WORKER_ID", ""), help="worker id")
    add_bus_flags(p)
    p.add_argument("--subject-prefix", default=env("FLUIDPD_SUBJECT_PREFIX", "fluidpd"))
    p.add_argument(
        "--engine", choices=("torch", "emulated"), default=env("FLUIDPD_ENGINE", "torch")
    )
    p.add_argument("--model", default=env("FLUIDPD_MODEL", "smollm2-135m"))
    p.add_argument("--device", default=env("FLUIDPD_DEVICE", "cpu"), help="cpu | cuda | cuda:N")
    p.add_argument(
        "--dtype",
        default=env("FLUIDPD_DTYPE", "auto"),
        choices=("auto", "float32", "bfloat16", "float16"),
        help="auto: bfloat16 on CUDA, float32 on CPU",
    )
    p.add_argument("--profile", default=env("FLUIDPD_PROFILE", ""))
    p.add_argument("--policy-config", default=env("FLUIDPD_POLICY_CONFIG", ""))
    p.add_argument("--threads", type=int, default=int(env("FLUIDPD_THREADS", "0")))
    p.add_argument("--block-size", type=int, default=int(env("FLUIDPD_BLOCK_SIZE", "16")))
    p.add_argument("--num-kv-blocks", type=int, default=int(env("FLUIDPD_NUM_KV_BLOCKS", "0")))
    p.add_argument(
        "--kv-cache-mib",
        type=int,
        default=int(env("FLUIDPD_KV_CACHE_MIB", str(DEFAULT_KV_CACHE_BYTES >> 20))),
        help="KV arena size when --num-kv-blocks is 0",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=float(env("FLUIDPD_GPU_MEMORY_UTILIZATION", "0")),
        help="vLLM's flag: size the KV arena so this process uses at most this fraction of "
        "the CUDA device's memory (instead of --kv-cache-mib; 0: off)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=int(env("FLUIDPD_MAX_MODEL_LEN", "0")),
        help="context limit in tokens (prompt + output; 0: the model's own); "
        "routers read it from the registry and /v1/models reports it",
    )
    p.add_argument(
        "--decode-reserve-tokens",
        type=int,
        default=int(env("FLUIDPD_DECODE_RESERVE_TOKENS", "256")),
        help="decode tokens reserved at admission beyond the prompt",
    )
    p.add_argument("--max-num-seqs", type=int, default=int(env("FLUIDPD_MAX_NUM_SEQS", "64")))
    p.add_argument("--time-scale", type=float, default=float(env("FLUIDPD_TIME_SCALE", "1.0")))
    p.add_argument("--heartbeat-s", type=float, default=float(env("FLUIDPD_HEARTBEAT_S", "1.0")))
    p.add_argument(
        "--telemetry-interval-s",
        type=float,
        default=float(env("FLUIDPD_TELEMETRY_INTERVAL_S", "0.02")),
        help="how often this worker publishes its pressure telemetry (design: ~20 ms)",
    )
    p.add_argument(
        "--transfer-timeout-s", type=float, default=float(env("FLUIDPD_TRANSFER_TIMEOUT_S", "10"))
    )
    p.add_argument(
        "--decode-wait-timeout-s",
        type=float,
        default=float(env("FLUIDPD_DECODE_WAIT_TIMEOUT_S", "60")),
        help="how long an accepted request waits for decode capacity before a clear error",
    )
    p.add_argument(
        "--expire-margin-s",
        type=float,
        default=float(env("FLUIDPD_EXPIRE_MARGIN_S", str(DEFAULT_EXPIRE_MARGIN_S))),
        help="drop queued prefills whose TTFT deadline passed by this much (< 0: never)",
    )
    p.add_argument(
        "--no-fluidtoken", action="store_true", default=env("FLUIDPD_FLUIDTOKEN", "1") == "0"
    )
    p.add_argument(
        "--migrate-min-remaining-s",
        type=float,
        default=float(env("FLUIDPD_MIGRATE_MIN_REMAINING_S", "0.2")),
        help="on a D->P switch, migrate decodes expected to run longer than this",
    )
    p.add_argument(
        "--no-migrate",
        action="store_true",
        default=env("FLUIDPD_MIGRATE", "1") == "0",
        help="on a D->P switch, wait for running decodes instead of live-migrating them",
    )
    p.add_argument(
        "--force-steal-ratio", type=float, default=float(env("FLUIDPD_FORCE_STEAL_RATIO", "-1"))
    )
    p.add_argument(
        "--kv-zero-on-free", action="store_true", default=env("FLUIDPD_KV_ZERO_ON_FREE", "0") == "1"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=int(env("FLUIDPD_METRICS_PORT", "0")),
        help="serve Prometheus /metrics on this port (0: off)",
    )
    p.add_argument("--metrics-host", default=env("FLUIDPD_METRICS_HOST", "127.0.0.1"))
    p.add_argument("--log-json", action="store_true", default=env("FLUIDPD_LOG_JSON", "0") == "1")
    return p


def config_from_args(role: Role, argv: list[str] | None) -> WorkerConfig:
    a = build_parser(role).parse_args(argv)
    return WorkerConfig(
        worker_id=a.id or default_worker_id(role),
        role=role,
        bus=bus_config_from_args(a),
        subject_prefix=a.subject_prefix,
        engine=a.engine,
        model=a.model,
        profile=a.profile,
        policy_config=a.policy_config,
        num_threads=a.threads,
        block_size=a.block_size,
        num_kv_blocks=a.num_kv_blocks,
        max_num_seqs=a.max_num_seqs,
        time_scale=a.time_scale,
        heartbeat_s=a.heartbeat_s,
        telemetry_interval_s=a.telemetry_interval_s,
        transfer_timeout_s=a.transfer_timeout_s,
        decode_wait_timeout_s=a.decode_wait_timeout_s,
        expire_margin_s=a.expire_margin_s,
        fluidtoken=not a.no_fluidtoken,
        migrate=not a.no_migrate,
        migrate_min_remaining_s=a.migrate_min_remaining_s,
        force_steal_ratio=a.force_steal_ratio,
        kv_zero_on_free=a.kv_zero_on_free,
        cluster_secret=os.environ.get("FLUIDPD_CLUSTER_SECRET", ""),
        log_json=a.log_json,
        metrics_port=a.metrics_port,
        kv_cache_bytes=a.kv_cache_mib * 1024 * 1024,
        gpu_memory_utilization=a.gpu_memory_utilization,
        max_model_len=a.max_model_len,
        device=a.device,
        dtype=a.dtype,
        decode_reserve_tokens=a.decode_reserve_tokens,
        metrics_host=a.metrics_host,
    )


async def serve(cfg: WorkerConfig) -> int:
    """Run the worker until SIGINT/SIGTERM (returns 0) or until it must exit after an
    engine failure (returns that status, services/worker/failure.py)."""
    from services.worker.runtime import WorkerRuntime

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with WorkerRuntime(cfg) as rt:
        announce_ready(f"worker_ready id={cfg.worker_id} role={cfg.role}")
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(rt.fatal.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        status = rt.exit_status
    return status


def main(role: Role, argv: list[str] | None = None) -> int:
    try:
        cfg = config_from_args(role, argv)
        configure_logging(json_logs=cfg.log_json, service=f"worker:{cfg.worker_id}")
    except ValueError as exc:  # a flag or env value out of range: one line, like argparse
        print(f"python -m services.{role}_worker: error: {exc}", file=sys.stderr)
        return 2
    try:
        status = run(serve(cfg))
    except FluidPDError as exc:  # bad credentials, missing model file, ...: one clear line
        print(f"worker {cfg.worker_id}: {exc}", file=sys.stderr)
        return 1
    return status


if __name__ == "__main__":
    # WorkerConfig rejects any other role (exit 2, one line), as for the packaged entry points.
    sys.exit(main(cast(Role, sys.argv[1] if len(sys.argv) > 1 else PREFILL), sys.argv[2:]))
