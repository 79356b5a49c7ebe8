"""Opening the Bus's nats-py connection: the client options a ``BusConfig`` maps to, and the
first connect, bounded by ``initial_connect_deadline_s`` and failed at once when the server
refuses our credentials (retrying cannot help). Reconnects after that are nats-py's own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
from nats.aio.client import Client

from shared.bus.config import BusConfig
from shared.bus.errors import BusConnectionError


def client_options(
    cfg: BusConfig,
    *,
    reconnected_cb: Callable[[], Awaitable[None]],
    disconnected_cb: Callable[[], Awaitable[None]],
    error_cb: Callable[[Exception], Awaitable[None]],
) -> dict[str, Any]:
    """The keyword arguments of ``nats.aio.client.Client.connect`` for ``cfg``. Pure."""
    return dict(
        servers=list(cfg.servers),
        name=cfg.name,
        connect_timeout=cfg.connect_timeout_s,
        allow_reconnect=True,
        # -1: nats-py retries forever, the first connect included; connect_first bounds
        # the first connect with initial_connect_deadline_s.
        max_reconnect_attempts=-1,
        reconnect_time_wait=cfg.reconnect_wait_s,
        ping_interval=cfg.ping_interval_s,
        max_outstanding_pings=cfg.max_outstanding_pings,
        drain_timeout=cfg.drain_timeout_s,
        pending_size=cfg.pending_bytes,
        user=cfg.user,
        password=cfg.password,
        token=cfg.token,
        nkeys_seed=cfg.nkeys_seed_file,
        user_credentials=cfg.creds_file,
        tls=cfg.tls_context(),
        tls_hostname=cfg.tls_hostname,
        inbox_prefix=cfg.reply_inbox_prefix(),
        reconnected_cb=reconnected_cb,
        disconnected_cb=disconnected_cb,
        error_cb=error_cb,
    )


def is_auth_refusal(exc: Exception) -> bool:
    """Whether a connection error says the server refused our credentials."""
    text = (str(exc) or type(exc).__name__).lower()
    return (
        "authorization" in text
        or "authentication" in text
        or isinstance(exc, nats.errors.AuthorizationError)
    )


async def connect_first(
    cfg: BusConfig, options: dict[str, Any], refused: asyncio.Future[str]
) -> Client:
    """Connect a new client with ``options``; returns it connected.

    ``refused`` is resolved (with the server's words) by the caller's error callback when
    the server refuses us. Raises BusConnectionError on refusal, on a connect error, or when
    ``cfg.initial_connect_deadline_s`` passes (None: wait forever); the client is then
    closed, so nats-py's reconnect loop stops.
    """
    nc = Client()
    connect = asyncio.ensure_future(nc.connect(**options))
    # Not asyncio.wait_for: on 3.11 it can swallow the cancel of nats-py's reconnect loop
    # and hang; racing explicit futures lets us close the client and move on.
    racing: set[asyncio.Future[Any]] = {connect, refused}
    done, _ = await asyncio.wait(
        racing,
        timeout=cfg.initial_connect_deadline_s,
        return_when=asyncio.FIRST_COMPLETED,
    )
    failure: str | None = None
    if refused in done:
        failure = f"cannot connect to NATS: the server refused us ({refused.result()})"
    elif connect not in done:
        failure = f"cannot connect to NATS within {cfg.initial_connect_deadline_s} s"
    elif connect.exception() is not None:
        exc = connect.exception()
        failure = f"cannot connect to NATS ({type(exc).__name__}: {exc})"
    if failure is not None:
        await nc.close()  # stops nats-py's reconnect loop
        connect.cancel()
        await asyncio.wait({connect}, timeout=2.0)
        raise BusConnectionError(failure)
    return nc
