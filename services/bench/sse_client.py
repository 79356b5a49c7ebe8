"""A minimal HTTP/1.1 client for the serve benchmark: one keep-alive connection, JSON POST,
Server-Sent Events back (chunked transfer encoding, as the router sends them).

Why not aiohttp: its client spends ~0.25 ms of Python per request on this 2-core machine
(request building, connection pool, stream reader), all of which the serve benchmark
counted as "router overhead" since the engine-direct baseline has no HTTP client at all.
This one writes the request in one ``write`` and parses chunks with two ``readline``s, so
what remains is the router, the bus and the wire. The official ``openai`` client is tested
against the router elsewhere (tests/test_http_e2e.py); this is a measuring instrument only.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SSEResponse:
    """Events of one streamed response, with the client's clock at each chunk."""

    sent_wall_s: float  # time.time() right before the request was written
    events: list[tuple[float, dict[str, Any]]] = field(default_factory=list)  # (s since send, data)
    event_walls_s: list[float] = field(default_factory=list)  # time.time() at each event


class SSEClient:
    """One connection to ``host:port``; requests run one at a time. Async context manager."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> SSEClient:
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Idempotent."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    async def post_stream(self, path: str, body: dict[str, Any]) -> SSEResponse:
        """POST ``body`` as JSON and read the SSE stream to its end (``data: [DONE]`` and
        the last chunk). Raises RuntimeError on a non-200 answer or an ``error`` event."""
        assert self._reader is not None and self._writer is not None, "use `async with`"
        reader = self._reader
        data = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        ).encode()
        out = SSEResponse(sent_wall_s=time.time())
        sent = time.perf_counter()
        self._writer.write(head + data)
        status = await reader.readline()
        headers = await self._headers()
        if b" 200 " not in status:
            raise RuntimeError(f"router answered {status.decode().strip()}: {headers}")
        if headers.get("transfer-encoding") != "chunked":
            raise RuntimeError(f"expected a chunked event stream, got headers {headers}")
        pending = b""
        while True:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                await reader.readline()  # the blank line after the last chunk
                return out
            chunk = await reader.readexactly(size + 2)
            now, now_wall = time.perf_counter(), time.time()
            pending += chunk[:-2]
            while b"\n\n" in pending:
                event, pending = pending.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    payload = line[5:].strip() if line.startswith(b"data:") else b""
                    if not payload or payload == b"[DONE]":
                        continue
                    parsed = json.loads(payload)
                    if "error" in parsed:
                        raise RuntimeError(f"stream error: {parsed['error']}")
                    out.events.append((now - sent, parsed))
                    out.event_walls_s.append(now_wall)

    async def _headers(self) -> dict[str, str]:
        assert self._reader is not None
        headers: dict[str, str] = {}
        while (line := await self._reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        return headers
