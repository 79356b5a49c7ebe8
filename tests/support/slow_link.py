"""A TCP relay that delays one direction: a slow link between a client and nats-server.

``SlowLink(host, port)`` listens on a free loopback port and relays every connection to
``host:port``. Bytes from the client are forwarded ``delay_s`` after they arrived (in
order; ``delay_s`` may change at any time and applies to bytes read from then on); bytes
from the server come back at once. Use as ``async with SlowLink(...) as link`` and connect
to ``link.url``.
"""

from __future__ import annotations

import asyncio
import contextlib


class SlowLink:
    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.delay_s = 0.0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"nats://{host}:{port}"

    async def __aenter__(self) -> SlowLink:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        await self._server.wait_closed()

    async def _relay(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        s_reader, s_writer = await asyncio.open_connection(*self.upstream)
        for coro in (self._delayed(c_reader, s_writer), self._direct(s_reader, c_writer)):
            task = asyncio.ensure_future(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _delayed(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        due: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def forward() -> None:
            while True:
                at, data = await due.get()
                await asyncio.sleep(max(0.0, at - loop.time()))  # the injected latency
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(forward())
        try:
            while data := await reader.read(65536):
                due.put_nowait((loop.time() + self.delay_s, data))
            await asyncio.Event().wait()  # client closed: keep forwarding until cancelled
        finally:
            sender.cancel()
            writer.close()

    async def _direct(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()
