"""Start real worker processes and talk to them over the bus like a router would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from services.bench.bus_client import BenchBusClient
from services.common.cluster_commands import router_url_of
from services.common.nats_auth import worker_user
from tests.support.nats_server import NatsServer

REPO = Path(__file__).resolve().parents[2]
# A bus to start processes on: a URL (no auth, or credentials in it), or a test server in
# ``users`` mode, where each process gets its own least-privilege user as ``fluidpd up``
# gives it (by environment, as services/common/cluster.py does).
Nats = str | NatsServer


def _connect(nats: Nats, user: str) -> tuple[str, dict[str, str]]:
    """(URL for --nats, extra environment) for a process logging in as ``user``."""
    if isinstance(nats, str):
        return nats, {}
    if user not in nats.users:
        return nats.url_with_auth, {}
    return nats.url, nats.users[user].env()


def client_url(nats: Nats) -> str:
    """The URL a test's own bus client uses: the operator's where the server has users
    (the test plays ``fluidpd ctl`` / the NATS CLI), else the URL itself."""
    if isinstance(nats, str):
        return nats
    return nats.url_for("operator") if nats.users else nats.url_with_auth


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
    role: str, worker_id: str, nats: Nats, *args: str, log_dir: Path | None = None, **env: str
) -> subprocess.Popen[bytes]:
    nats_url, auth_env = _connect(nats, worker_user(worker_id))
    env = {**auth_env, **env}
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
def worker_pair(nats: Nats, log_dir: Path, *args: str) -> Iterator[str]:
    """Prefill worker ``p0`` and decode worker ``d0`` with ``args``; yields the URL for the
    test's own client (``client_url``). On exit both get SIGTERM and must exit 0
    (AssertionError otherwise)."""
    procs = [
        start_worker("prefill", "p0", nats, *args, log_dir=log_dir),
        start_worker("decode", "d0", nats, *args, log_dir=log_dir),
    ]
    try:
        yield client_url(nats)
    finally:
        assert stop_all(procs) == [0, 0], "workers must exit cleanly on SIGTERM"


def start_router(
    nats: Nats, model: str, *args: str, log_dir: Path, name: str = "router"
) -> tuple[subprocess.Popen[bytes], str]:
    """A router process for ``model`` (NATS user ``router`` on a server with users);
    returns (process, base URL) once it listens (on a port it bound itself: ``--port 0``,
    the URL from its ready line)."""
    nats_url, auth_env = _connect(nats, "router")
    cmd = [sys.executable, "-m", "services.router", "--nats", nats_url, "--model", model]
    proc = subprocess.Popen(
        [*cmd, "--port", "0", *args],
        cwd=REPO,
        env=worker_env(**auth_env),
        stdout=subprocess.PIPE,
        stderr=open(log_dir / f"{name}.log", "wb"),  # noqa: SIM115
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()  # blocks until the router is listening
    url = router_url_of(line) if line.startswith("router_ready") else None
    assert url is not None and url.startswith("http://127.0.0.1:"), line
    return proc, url


def wait_healthy(base_url: str, timeout_s: float = 60.0) -> None:
    """Poll ``/health`` until 200: both roles registered (no event for "the router sees the
    registry"). Blocking; raises TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{base_url}/health") as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base_url}/health not 200 within {timeout_s} s")
        time.sleep(0.1)


def cli_generate(model: str, prompt: str, max_tokens: int, *, chat: bool = False) -> Any:
    """``fluidpd generate --json --ignore-eos`` (greedy) in a subprocess: the ground truth."""
    cmd = [sys.executable, "-m", "services.cli.main", "generate", "--model", model]
    cmd += ["--prompt", prompt, "--max-tokens", str(max_tokens), "--json", "--ignore-eos"]
    if chat:
        cmd.append("--chat")
    out = subprocess.run(cmd, check=True, capture_output=True, cwd=REPO, env=worker_env())
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


class BusClient(BenchBusClient):
    """The bench client with test defaults: a 2 s TTFT budget (so FluidToken's policy
    sees realistic deadlines) and a patient submit acknowledgement (slow CI machines)."""

    def __init__(self, nats: Nats) -> None:
        super().__init__(client_url(nats), ttft_budget_s=2.0, ack_timeout_s=30.0)
