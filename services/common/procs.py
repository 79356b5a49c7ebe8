"""Child processes in their own process groups, with their output pumped and remembered.

A :class:`ChildProcess` starts one command in a new session (so it and everything it
spawns form one process group that ``stop()`` signals as a whole), merges its stdout and
stderr, and pumps every line to a :class:`LogSink` (the terminal with a ``[name]``
prefix, a file, or nowhere) while keeping the last lines for error messages. Readiness is
event-driven: ``ready`` is set when a line containing ``ready_marker`` appears, ``exited``
when the output ends. All methods are blocking and thread-safe enough for one owner.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TextIO

from services.common.cpus import pin_self

TAIL_LINES = 200
_PR_SET_PDEATHSIG = 1


class LogSink:
    """Where children's lines go: ``terminal`` (prefixed, to ``stream``), a ``log_dir``
    (one ``<name>.log`` per child), or neither (kept only as a tail). Thread-safe."""

    def __init__(
        self, *, terminal: bool = False, log_dir: Path | None = None, stream: TextIO | None = None
    ) -> None:
        self.terminal = terminal
        self.log_dir = Path(log_dir) if log_dir else None
        self.stream = stream
        self._lock = threading.Lock()
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)

    def open(self, name: str) -> Callable[[str], None]:
        """A writer for child ``name``'s lines (each without its newline)."""
        handle = None
        if self.log_dir is not None:
            handle = (self.log_dir / f"{name}.log").open("a", encoding="utf-8", buffering=1)
        prefix = f"[{name}] "

        def write(line: str) -> None:
            if handle is not None:
                handle.write(line + "\n")
            if self.terminal:
                out = self.stream or sys.stdout
                with self._lock, contextlib.suppress(OSError, ValueError):
                    out.write(prefix + line + "\n")
                    out.flush()

        return write


def _die_with_parent() -> None:  # runs in the child between fork and exec (Linux only)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _child_setup(die_with_parent: bool, cpus: tuple[int, ...]) -> Callable[[], None] | None:
    """The ``preexec_fn`` for a child: parent-death signal and/or CPU pinning."""
    pin = pin_self(cpus)
    if not die_with_parent:
        return pin

    def setup() -> None:
        _die_with_parent()
        if pin is not None:
            pin()

    return setup


class ChildProcess:
    """One child command. ``start()`` spawns it; ``stop()`` ends its whole process group."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        ready_marker: str | None = None,
        sink: LogSink | None = None,
        die_with_parent: bool = False,
        cpus: tuple[int, ...] = (),
        on_event: threading.Event | None = None,
    ) -> None:
        """``die_with_parent``: ask Linux to SIGTERM the child when the *thread* that
        started it dies — only safe when ``start()`` runs on the main thread.
        ``cpus``: pin the child and all its threads to these CPUs (``()``: no pinning).
        ``on_event`` is set (never cleared) whenever ready or exited changes."""
        self.name = name
        self.argv = list(argv)
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.ready_marker = ready_marker
        self.sink = sink or LogSink()
        self.die_with_parent = die_with_parent
        self.cpus = cpus
        self.ready = threading.Event()
        self.ready_line: str | None = None  # the output line that set ``ready``
        self.exited = threading.Event()
        self._on_event = on_event
        self._tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def tail(self, lines: int = 20) -> str:
        """The child's last ``lines`` output lines."""
        return "\n".join(list(self._tail)[-lines:])

    def start(self) -> None:
        """Spawn the child in a new session. Raises OSError when the command cannot run."""
        if self._proc is not None:
            return
        self._proc = subprocess.Popen(
            self.argv,
            env=self.env,
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
            start_new_session=True,  # own process group: stop() reaches grandchildren too
            preexec_fn=_child_setup(self.die_with_parent, self.cpus),
        )
        if self.ready_marker is None:
            self.ready.set()
        self._reader = threading.Thread(target=self._pump, name=f"log-{self.name}", daemon=True)
        self._reader.start()

    def _notify(self) -> None:
        if self._on_event is not None:
            self._on_event.set()

    def _pump(self) -> None:
        # Drain the pipe for the child's whole life so it never blocks on a full pipe.
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        write = self.sink.open(self.name)
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            self._tail.append(line)
            write(line)
            if not self.ready.is_set() and self.ready_marker and self.ready_marker in line:
                self.ready_line = line  # before set(): a waiter woken by it reads it
                self.ready.set()
                self._notify()
        proc.wait()
        self.exited.set()
        self._notify()

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child's process group (no-op once it has exited)."""
        if self._proc is None or self._proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    def wait(self, timeout_s: float | None = None) -> int | None:
        """Wait for exit; returns the exit status, or None on timeout."""
        if self._proc is None:
            return None
        try:
            return self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the group, wait ``grace_s``, then SIGKILL the group. Idempotent.

        The group is SIGKILLed even after a clean exit of the leader, so no grandchild
        outlives it. Returns the leader's exit status."""
        if self._proc is None:
            return None
        self.signal(signal.SIGTERM)
        rc = self.wait(grace_s)
        if rc is None:
            self.signal(signal.SIGKILL)
            rc = self.wait(5.0)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)  # stragglers in the group
        if self._reader is not None:
            self._reader.join(2.0)
        return rc


def stop_all(children: Sequence[ChildProcess], grace_s: float = 10.0) -> dict[str, int | None]:
    """SIGTERM every child at once, give them ``grace_s`` together, SIGKILL the rest.

    Returns name → exit status."""
    for child in children:
        child.signal(signal.SIGTERM)
    deadline_s = time.monotonic() + grace_s
    for child in children:
        child.wait(max(0.0, deadline_s - time.monotonic()))
    return {child.name: child.stop(0.0) for child in children}  # SIGKILLs any straggler
