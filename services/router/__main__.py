"""``python -m services.router``: flags and env → RouterConfig → run until SIGINT/SIGTERM.

Prints ``router_ready url=http://HOST:PORT`` on stdout (one line, flushed) once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from services.common.bus_flags import add_bus_flags, bus_config_from_args
from services.common.logging import configure_logging
from services.common.service import announce_ready
from services.router.config import PAIRING_POLICIES, RouterConfig, default_router_id
from shared.aio import run
from shared.policy.admission import DEFAULT_DECODE_BACKLOG_BATCHES, DEFAULT_TTFT_MULTIPLE


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="python -m services.router", description="FluidPD router (OpenAI-compatible HTTP API)"
    )
    p.add_argument("--id", default=env("FLUIDPD_ROUTER_ID", "") or default_router_id())
    p.add_argument("--host", default=env("FLUIDPD_ROUTER_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env("FLUIDPD_ROUTER_PORT", "8000")))
    add_bus_flags(p)
    p.add_argument(
        "--api-key",
        default=env("FLUIDPD_API_KEY", ""),
        help="require 'Authorization: Bearer <key>' on /v1/* (prefer the env var: "
        "a flag shows in ps)",
    )
    p.add_argument("--subject-prefix", default=env("FLUIDPD_SUBJECT_PREFIX", "fluidpd"))
    p.add_argument("--model", default=env("FLUIDPD_MODEL", "smollm2-135m"))
    p.add_argument("--served-model-name", default=env("FLUIDPD_SERVED_MODEL_NAME", ""))
    p.add_argument(
        "--pairing", choices=PAIRING_POLICIES, default=env("FLUIDPD_PAIRING", "pressure")
    )
    p.add_argument(
        "--short-prompt-tokens", type=int, default=int(env("FLUIDPD_SHORT_PROMPT_TOKENS", "0"))
    )
    p.add_argument("--ttft-slo-ms", type=float, default=float(env("FLUIDPD_TTFT_SLO_MS", "2000")))
    p.add_argument(
        "--request-timeout-s", type=float, default=float(env("FLUIDPD_REQUEST_TIMEOUT_S", "600"))
    )
    p.add_argument(
        "--submit-timeout-s", type=float, default=float(env("FLUIDPD_SUBMIT_TIMEOUT_S", "5"))
    )
    p.add_argument(
        "--shed-ttft-multiple",
        type=float,
        default=float(env("FLUIDPD_SHED_TTFT_MULTIPLE", str(DEFAULT_TTFT_MULTIPLE))),
        help="503 + Retry-After when the predicted TTFT exceeds this multiple of the "
        "TTFT SLO (0: never shed)",
    )
    p.add_argument(
        "--shed-decode-backlog",
        type=float,
        default=float(env("FLUIDPD_SHED_DECODE_BACKLOG", str(DEFAULT_DECODE_BACKLOG_BATCHES))),
        help="503 + Retry-After when every decode worker has this many batches "
        "(x its max-num-seqs) of requests waiting for admission (0: never)",
    )
    p.add_argument(
        "--stream-header-hold-s",
        default=env("FLUIDPD_STREAM_HEADER_HOLD_S", "auto"),
        help="how long a streamed response's 200 waits for its first token, so a request "
        "dropped before it gets a 503 + Retry-After instead of an in-band error "
        "('auto': TTFT SLO + 15 s; 0: send headers at once)",
    )
    p.add_argument("--log-json", action="store_true", default=env("FLUIDPD_LOG_JSON") == "1")
    return p


def parse_hold_s(value: str) -> float | None:
    """``auto`` -> None, else a number of seconds. Raises ValueError otherwise."""
    if value.strip().lower() == "auto":
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(
            f"--stream-header-hold-s must be 'auto' or seconds, got {value!r}"
        ) from None


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """Raises ValueError for invalid settings."""
    return RouterConfig(
        id=args.id,
        host=args.host,
        port=args.port,
        bus=bus_config_from_args(args),
        api_key=args.api_key,
        subject_prefix=args.subject_prefix,
        model=args.model,
        served_model_name=args.served_model_name,
        pairing=args.pairing,
        short_prompt_tokens=args.short_prompt_tokens,
        ttft_slo_ms=args.ttft_slo_ms,
        request_timeout_s=args.request_timeout_s,
        submit_timeout_s=args.submit_timeout_s,
        shed_ttft_multiple=args.shed_ttft_multiple,
        shed_decode_backlog=args.shed_decode_backlog,
        stream_header_hold_s=parse_hold_s(args.stream_header_hold_s),
        log_json=args.log_json,
    )


async def serve(cfg: RouterConfig) -> None:
    """Run the router until SIGINT/SIGTERM."""
    from services.router.app import Router

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with Router(cfg) as router:
        announce_ready(f"router_ready url={router.url}")
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        cfg = config_from_args(args)
        configure_logging(cfg.log_json, "router")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run(serve(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
