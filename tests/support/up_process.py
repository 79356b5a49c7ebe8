"""`fluidpd up` in a subprocess, its output collected by a thread (tests/test_up.py,
tests/test_nats_auth.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

READY = "fluidpd up: ready"


class UpProcess:
    """`fluidpd up` in a subprocess with its output collected by a thread."""

    def __init__(self, args: list[str], state_file: Path, **env: str) -> None:
        self.env = {**os.environ, "FLUIDPD_STATE_FILE": str(state_file), "PYTHONUNBUFFERED": "1"}
        self.env.update(env)
        self.env.pop("FLUIDPD_NATS_URL", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli.main", "up", *args],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.done = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith(READY):
                self.ready.set()
        self.done.set()

    def output(self) -> str:
        return "\n".join(self.lines[-60:])

    def wait_ready(self, timeout_s: float) -> None:
        # Wakes on the ready line or on exit (EOF), whichever comes first.
        deadline = time.monotonic() + timeout_s
        while not self.ready.is_set():
            if self.done.is_set() or time.monotonic() > deadline:
                raise AssertionError(f"fluidpd up not ready:\n{self.output()}")
            self.ready.wait(0.2)

    def kill_tree(self) -> None:
        try:
            procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(True)]
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        self.proc.kill()
        self.proc.wait(10)
