"""Start real worker processes and talk to them over the bus like a router would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from services.bench.bus_client import BenchBusClient

REPO = Path(__file__).resolve().parents[2]


def worker_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        UCX_WARN_UNUSED_ENV_VARS="n",
        UCXPY_PROGRESS_MODE="blocking",
        FLUIDPD_CLUSTER_SECRET="test-secret",
        PYTHONPATH=str(REPO),
    )
    env.update(extra)
    return env


def start_worker(
    role: str, worker_id: str, nats_url: str, *args: str, log_dir: Path | None = None, **env: str
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        f"services.{role}_worker",
        "--id",
        worker_id,
        "--nats",
        nats_url,
        "--heartbeat-s",
        "0.3",
        *args,
    ]
    out = open(log_dir / f"{worker_id}.log", "wb") if log_dir else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(
        cmd, env=worker_env(**env), stdout=out, stderr=subprocess.STDOUT, cwd=REPO
    )


def stop_all(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = 10.0) -> list[int]:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout_s))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes


@contextmanager
def worker_pair(nats_url: str, log_dir: Path, *args: str) -> Iterator[str]:
    """Prefill worker ``p0`` and decode worker ``d0`` with ``args``; yields the NATS url.
    On exit both get SIGTERM and must exit 0 (AssertionError otherwise)."""
    procs = [
        start_worker("prefill", "p0", nats_url, *args, log_dir=log_dir),
        start_worker("decode", "d0", nats_url, *args, log_dir=log_dir),
    ]
    try:
        yield nats_url
    finally:
        assert stop_all(procs) == [0, 0], "workers must exit cleanly on SIGTERM"


class BusClient(BenchBusClient):
    """The bench client with test defaults: a 2 s TTFT budget (so FluidToken's policy
    sees realistic deadlines) and a patient submit acknowledgement (slow CI machines)."""

    def __init__(self, nats_url: str) -> None:
        super().__init__(nats_url, ttft_budget_s=2.0, ack_timeout_s=30.0)
