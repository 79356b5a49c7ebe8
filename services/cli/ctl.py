"""``fluidpd ctl``: operator commands over NATS (status, switch, policy). Never imports torch.

The NATS URL comes from ``--nats``, else ``$FLUIDPD_NATS_URL``, else the file that a
running ``fluidpd up`` recorded, else ``nats://127.0.0.1:4222``; credentials likewise
(``resolve_nats_auth``: the environment, else that file's operator user). Failures print one line
to stderr (no traceback) and exit non-zero: 2 for NATS/controller trouble, 1 for a
refused command (e.g. a switch answered with ``ok=false``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
from typing import Any

from services.cli.up_state import read_state
from services.common.logging import configure_logging
from shared.bus import (
    Bus,
    BusConfig,
    BusConnectionError,
    BusError,
    BusNoRespondersError,
    BusTimeoutError,
    RemoteError,
)
from shared.messages import (
    Message,
    MessageError,
    PolicyCommand,
    PolicyReply,
    StatusReply,
    StatusRequest,
    Subjects,
    SwitchCommand,
    SwitchReply,
    WorkerRow,
    encode,
)
from shared.policy.roles import ROLES

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


class CtlError(Exception):
    """A one-line, user-facing failure; ``exit_code`` is what main returns."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def resolve_nats_url(flag: str | None) -> str:
    """--nats, then $FLUIDPD_NATS_URL, then `fluidpd up`'s state file, then the default."""
    if flag:
        return flag
    if os.environ.get("FLUIDPD_NATS_URL"):
        return os.environ["FLUIDPD_NATS_URL"]
    state = read_state()
    if state and isinstance(state.get("nats_url"), str):
        return str(state["nats_url"])
    return DEFAULT_NATS_URL


def resolve_nats_auth(url: str) -> dict[str, str]:
    """BusConfig credential/TLS options: $FLUIDPD_NATS_USER + $FLUIDPD_NATS_PASSWORD or
    $FLUIDPD_NATS_CREDS, else the operator credentials `fluidpd up` recorded for this very
    URL; plus $FLUIDPD_NATS_TLS_CA. Pure apart from reading the environment and state."""
    env = os.environ
    out: dict[str, str] = {}
    if env.get("FLUIDPD_NATS_USER"):
        out.update(user=env["FLUIDPD_NATS_USER"], password=env.get("FLUIDPD_NATS_PASSWORD", ""))
    elif env.get("FLUIDPD_NATS_CREDS"):
        out["creds_file"] = env["FLUIDPD_NATS_CREDS"]
    else:
        state = read_state()
        if state and state.get("nats_url") == url and isinstance(state.get("nats_user"), str):
            out.update(user=state["nats_user"], password=str(state.get("nats_password", "")))
    if env.get("FLUIDPD_NATS_TLS_CA"):
        out["tls_ca_file"] = env["FLUIDPD_NATS_TLS_CA"]
    return out


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--nats",
        default=None,
        help="NATS URL (default: $FLUIDPD_NATS_URL, "
        "the running `fluidpd up`, or nats://127.0.0.1:4222)",
    )
    common.add_argument(
        "--subject-prefix", default=os.environ.get("FLUIDPD_SUBJECT_PREFIX", "fluidpd")
    )
    common.add_argument("--timeout", type=float, default=None, help="seconds to wait for a reply")
    p = argparse.ArgumentParser(
        prog="fluidpd ctl",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("status", parents=[common], help="every live worker")
    st.add_argument("--json", action="store_true", help="print a JSON list of workers")
    sw = sub.add_parser("switch", parents=[common], help="switch a worker's role in place")
    sw.add_argument("worker")
    sw.add_argument("role", choices=ROLES)
    po = sub.add_parser("policy", parents=[common], help="pause/resume automatic FluidRole")
    po.add_argument("mode", choices=("pause", "resume"))
    return p


def row_to_json(row: WorkerRow) -> dict[str, Any]:
    """The public JSON shape of one worker (stable keys; see `fluidpd ctl status --json`)."""
    return {
        "id": row.worker_id,
        "role": row.role,
        "state": row.state,
        "free_blocks": row.free_blocks,
        "total_blocks": row.total_blocks,
        "ppi": row.ppi,
        "dpi_load": row.dpi_load,
        "dpi_adm": row.dpi_adm,
        "stolen_tokens": row.stolen_tokens,
        "pid": row.pid,
        "last_seen_s": row.last_seen_s,
    }


def format_table(reply: StatusReply) -> str:
    """A fixed-width table for a person. Pure."""
    head = (
        "ID",
        "ROLE",
        "STATE",
        "KV FREE/TOTAL",
        "PPI",
        "DPI_LOAD",
        "DPI_ADM",
        "STOLEN",
        "PID",
        "SEEN",
    )
    rows = [head] + [
        (
            w.worker_id,
            w.role,
            w.state,
            f"{w.free_blocks}/{w.total_blocks}",
            f"{w.ppi:.2f}",
            f"{w.dpi_load:.2f}",
            f"{w.dpi_adm:.2f}",
            str(w.stolen_tokens),
            str(w.pid),
            "-" if w.last_seen_s < 0 else f"{w.last_seen_s:.1f}s",
        )
        for w in reply.workers
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    policy = "auto" if reply.auto else "paused"
    lines.append(f"{len(reply.workers)} worker(s); FluidRole policy: {policy}")
    return "\n".join(lines)


def message_json(msg: Message) -> dict[str, Any]:
    """A reply as plain JSON (without the codec's _t/_v keys)."""
    doc: dict[str, Any] = json.loads(encode(msg, json_mode=True))
    return {k: v for k, v in doc.items() if not k.startswith("_")}


async def _request(
    args: argparse.Namespace,
    url: str,
    subject_of: str,
    msg: Message,
    reply_type: type[Any],
    timeout_s: float,
) -> Any:
    subjects = Subjects(args.subject_prefix)
    subject = getattr(subjects, subject_of)(
        *([args.worker] if subject_of == "worker_switch" else [])
    )
    cfg = BusConfig.from_url(
        url,
        **resolve_nats_auth(url),
        name="fluidpd-ctl",
        initial_connect_deadline_s=3.0,
        connect_timeout_s=2.0,
        reconnect_wait_s=0.2,
        drain_timeout_s=1.0,
    )
    bus = Bus(cfg, subjects)
    try:
        # nats-py retries an unreachable server forever when reconnects are allowed, so
        # the bus's own connect deadline is not enough: bound it here.
        await asyncio.wait_for(bus.start(), 4.0)
    except (BusConnectionError, TimeoutError):
        await _quiet_stop(bus)
        raise CtlError(f"cannot reach NATS at {_redact(url)}") from None
    try:
        return await bus.request(subject, msg, reply_type, timeout_s)
    except BusNoRespondersError:
        who = f"worker {args.worker}" if subject_of == "worker_switch" else "the controller"
        raise CtlError(
            f"no answer from {who}: is it running? (no responders on {subject})"
        ) from None
    except BusTimeoutError:
        who = f"worker {args.worker}" if subject_of == "worker_switch" else "the controller"
        raise CtlError(f"{who} did not answer within {timeout_s:g} s") from None
    except BusConnectionError as exc:
        raise CtlError(f"lost the NATS connection: {exc}") from None
    finally:
        await _quiet_stop(bus)


async def _quiet_stop(bus: Bus) -> None:
    with contextlib.suppress(TimeoutError, BusError, OSError):
        await asyncio.wait_for(bus.stop(), 2.0)


def _redact(url: str) -> str:
    return ",".join(u.split("@")[-1] for u in url.split(","))


async def _run(args: argparse.Namespace) -> int:
    url = resolve_nats_url(args.nats)
    if args.cmd == "status":
        timeout_s = args.timeout or 3.0
        reply: StatusReply = await _request(
            args, url, "controller_status", StatusRequest(), StatusReply, timeout_s
        )
        if args.json:
            print(json.dumps([row_to_json(w) for w in reply.workers], indent=2))
        else:
            print(format_table(reply))
        return 0
    if args.cmd == "switch":
        timeout_s = args.timeout or 60.0  # a D→P drain can take seconds
        try:
            sw: SwitchReply = await _request(
                args, url, "worker_switch", SwitchCommand(role=args.role), SwitchReply, timeout_s
            )
        except RemoteError as exc:
            print(json.dumps({"ok": False, "error": str(exc)}))
            return 1
        print(json.dumps(message_json(sw)))
        return 0 if sw.ok else 1
    timeout_s = args.timeout or 3.0
    pol: PolicyReply = await _request(
        args,
        url,
        "controller_policy",
        PolicyCommand(auto=args.mode == "resume"),
        PolicyReply,
        timeout_s,
    )
    print(json.dumps(message_json(pol)))
    return 0 if pol.ok else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Only errors from the bus: the operator wants the answer, not our logs.
    configure_logging(json_logs=False, service="ctl", level=logging.ERROR)
    try:
        return asyncio.run(_run(args))
    except CtlError as exc:
        print(f"fluidpd ctl: {exc}", file=sys.stderr)
        return exc.exit_code
    except (RemoteError, BusError, MessageError, ValueError) as exc:
        print(f"fluidpd ctl: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
