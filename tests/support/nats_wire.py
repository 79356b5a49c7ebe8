"""A tiny NATS wire-protocol client over a plain TCP socket — what the NATS CLI sends.

Used to check that operators' ``nats req``/``nats pub`` work against our services without
going through nats-py. Blocking; from async tests call it with ``asyncio.to_thread`` (the
responder usually runs in the test's own event loop).

Protocol (https://docs.nats.io/reference/reference-protocols/nats-protocol): the server
sends ``INFO {...}``; we send ``CONNECT {...}``, ``SUB <inbox> <sid>``, ``PUB <subject>
<inbox> <n>`` + payload, ``PING``; the server answers ``MSG <subject> <sid> <n>`` +
payload (or ``HMSG`` with a 503 status header when nobody listens).
"""

from __future__ import annotations

import json
import os
import socket
import time

_CRLF = b"\r\n"


class WireError(RuntimeError):
    """Protocol error, -ERR from the server, or no responders."""


class WireTimeout(WireError):
    """No reply within the timeout."""


class _Conn:
    def __init__(
        self, host: str, port: int, timeout_s: float, user: str | None, password: str | None
    ) -> None:
        self.deadline = time.monotonic() + timeout_s
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.buf = b""
        info = self.read_line()
        if not info.startswith(b"INFO "):
            raise WireError(f"expected INFO, got {info[:40]!r}")
        connect: dict[str, object] = {
            "verbose": False,
            "pedantic": False,
            "lang": "raw",
            "version": "0",
            "protocol": 1,
            "headers": True,
            "no_responders": True,
        }
        if user is not None:
            connect["user"] = user
            connect["pass"] = password or ""
        self.send(b"CONNECT " + json.dumps(connect).encode() + _CRLF)

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError as exc:  # e.g. the server closed us after an auth failure
            raise WireError(f"connection lost: {exc}") from None

    def _fill(self) -> None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise WireTimeout("timed out")
        self.sock.settimeout(remaining)
        try:
            chunk = self.sock.recv(65536)
        except TimeoutError:
            raise WireTimeout("timed out") from None
        except OSError as exc:
            raise WireError(f"connection lost: {exc}") from None
        if not chunk:
            raise WireError("connection closed by server")
        self.buf += chunk

    def read_line(self) -> bytes:
        while _CRLF not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(_CRLF, 1)
        return line

    def read_exact(self, n: int) -> bytes:
        while len(self.buf) < n + 2:
            self._fill()
        data, self.buf = self.buf[:n], self.buf[n + 2 :]
        return data

    def next_message(self) -> tuple[bytes, bytes]:
        """Read until a MSG/HMSG arrives; returns (headers, payload). Answers PINGs."""
        while True:
            line = self.read_line()
            if line == b"PING":
                self.send(b"PONG" + _CRLF)
            elif line in (b"PONG", b"+OK") or line.startswith(b"INFO "):
                continue
            elif line.startswith(b"-ERR"):
                raise WireError(line.decode(errors="replace"))
            elif line.startswith(b"MSG "):
                size = int(line.split()[-1])
                return b"", self.read_exact(size)
            elif line.startswith(b"HMSG "):
                parts = line.split()
                header_len, total_len = int(parts[-2]), int(parts[-1])
                raw = self.read_exact(total_len)
                return raw[:header_len], raw[header_len:]
            else:
                raise WireError(f"unexpected line {line[:40]!r}")

    def close(self) -> None:
        self.sock.close()


def raw_request(
    host: str,
    port: int,
    subject: str,
    payload: bytes,
    timeout_s: float = 2.0,
    user: str | None = None,
    password: str | None = None,
) -> bytes:
    """``nats req SUBJECT PAYLOAD``: send one request, return the reply payload.

    Raises WireTimeout (no reply in time) or WireError (no responders, -ERR, protocol).
    """
    conn = _Conn(host, port, timeout_s, user, password)
    try:
        inbox = f"_INBOX.raw{os.getpid()}x{time.monotonic_ns()}"
        conn.send(f"SUB {inbox} 1\r\n".encode())
        conn.send(f"PUB {subject} {inbox} {len(payload)}\r\n".encode() + payload + _CRLF)
        conn.send(b"PING" + _CRLF)
        headers, data = conn.next_message()
        if headers.startswith(b"NATS/1.0 503"):
            raise WireError("no responders")
        return data
    finally:
        conn.close()


def raw_publish(
    host: str,
    port: int,
    subject: str,
    payload: bytes,
    timeout_s: float = 2.0,
    user: str | None = None,
    password: str | None = None,
) -> list[str]:
    """``nats pub SUBJECT PAYLOAD``; returns once the server has processed it (PONG), with
    the ``-ERR`` lines it sent meanwhile (e.g. a permissions violation; the server keeps
    the connection open after one)."""
    conn = _Conn(host, port, timeout_s, user, password)
    errors: list[str] = []
    try:
        conn.send(f"PUB {subject} {len(payload)}\r\n".encode() + payload + _CRLF)
        conn.send(b"PING" + _CRLF)
        while (line := conn.read_line()) != b"PONG":
            if line.startswith(b"-ERR"):
                errors.append(line.decode(errors="replace"))
    finally:
        conn.close()
    return errors


def ping(
    host: str,
    port: int,
    timeout_s: float = 2.0,
    user: str | None = None,
    password: str | None = None,
) -> None:
    """Connect, PING, wait for PONG (raises WireError/WireTimeout/OSError)."""
    conn = _Conn(host, port, timeout_s, user, password)
    try:
        conn.send(b"PING" + _CRLF)
        while True:
            line = conn.read_line()
            if line == b"PONG":
                return
            if line.startswith(b"-ERR"):
                raise WireError(line.decode(errors="replace"))
    finally:
        conn.close()


def raw_subscribe(
    host: str,
    port: int,
    subject: str,
    timeout_s: float = 2.0,
    user: str | None = None,
    password: str | None = None,
) -> list[str]:
    """``nats sub SUBJECT``, only as far as the server's verdict: returns the ``-ERR`` lines
    it sent before answering a PING (empty: the subscription was accepted)."""
    conn = _Conn(host, port, timeout_s, user, password)
    errors: list[str] = []
    try:
        conn.send(f"SUB {subject} 1\r\nPING\r\n".encode())
        while (line := conn.read_line()) != b"PONG":
            if line.startswith(b"-ERR"):
                errors.append(line.decode(errors="replace"))
    finally:
        conn.close()
    return errors
