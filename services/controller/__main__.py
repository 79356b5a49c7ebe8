"""``python -m services.controller --nats URL [--policy-config FILE] [--policy adaptive|paper]
[--auto|--no-auto]``."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

import structlog

from services.common.bus_flags import add_bus_flags, bus_config_from_args
from services.common.logging import configure_logging
from services.controller.config import ControllerConfig
from services.controller.controller import run_until_signalled
from shared.aio import run
from shared.bus import BusConnectionError
from shared.policy.config import PolicyConfig
from shared.policy.errors import PolicyConfigError


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m services.controller", description=__doc__)
    add_bus_flags(p)
    p.add_argument("--subject-prefix", default=env("FLUIDPD_SUBJECT_PREFIX", "fluidpd"))
    p.add_argument(
        "--policy-config",
        default=env("FLUIDPD_POLICY_CONFIG", ""),
        help="PolicyConfig JSON file (thresholds, N_persist, cooldown, interval)",
    )
    p.add_argument(
        "--policy",
        default=env("FLUIDPD_POLICY", ""),
        help="FluidRole rule set: adaptive (default: sized moves, settle-time hysteresis, "
        "DPI_adm guards) or paper (eq. 22-23 literally, one worker per decision, fixed "
        "cooldown); overrides the policy config's 'rules'",
    )
    p.add_argument(
        "--decision-interval-s",
        type=float,
        default=None,
        help="override the policy config's decision interval",
    )
    auto = p.add_mutually_exclusive_group()
    auto.add_argument(
        "--auto",
        dest="auto",
        action="store_true",
        default=True,
        help="send decided switches to workers (default)",
    )
    auto.add_argument(
        "--no-auto", dest="auto", action="store_false", help="decide and publish only; never switch"
    )
    p.add_argument(
        "--metrics-port", type=int, default=int(env("FLUIDPD_CONTROLLER_METRICS_PORT", "0"))
    )
    p.add_argument("--metrics-host", default=env("FLUIDPD_CONTROLLER_METRICS_HOST", "127.0.0.1"))
    p.add_argument("--heartbeat-s", type=float, default=float(env("FLUIDPD_HEARTBEAT_S", "1.0")))
    p.add_argument("--log-json", action="store_true", default=env("FLUIDPD_LOG_JSON", "0") == "1")
    return p


def config_from_args(argv: list[str] | None) -> ControllerConfig:
    """Raises PolicyConfigError (bad policy file) or ValueError (bad flag)."""
    a = build_parser().parse_args(argv)
    policy = PolicyConfig.load(a.policy_config) if a.policy_config else PolicyConfig()
    if a.decision_interval_s is not None:
        policy = PolicyConfig.from_dict(
            {**policy.to_dict(), "decision_interval_s": a.decision_interval_s}
        )
    if a.policy:  # validated by PolicyConfig (PolicyConfigError: one line, exit 2)
        policy = PolicyConfig.from_dict({**policy.to_dict(), "rules": a.policy})
    cfg = ControllerConfig(
        bus=bus_config_from_args(a),
        metrics_host=a.metrics_host,
        subject_prefix=a.subject_prefix,
        policy=policy,
        auto=a.auto,
        metrics_port=a.metrics_port,
        heartbeat_s=a.heartbeat_s,
    )
    configure_logging(json_logs=a.log_json, service="controller")
    return cfg


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = config_from_args(argv)
    except (PolicyConfigError, ValueError, OSError) as exc:
        print(f"controller: {exc}", file=sys.stderr)
        return 2

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run_until_signalled(cfg, stop)

    try:
        run(serve())
    except BusConnectionError as exc:
        structlog.get_logger("fluidpd.controller").error("controller_failed", error=str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
