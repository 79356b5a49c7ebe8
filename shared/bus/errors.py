"""Typed errors of the bus layer."""

from __future__ import annotations

from shared.errors import FluidPDError


class BusError(FluidPDError):
    """A bus operation failed (connection, protocol)."""

    code = "bus_error"
    http_status = 503


class BusConnectionError(BusError):
    """Not connected to NATS (closed, or the initial connect gave up)."""

    code = "bus_unavailable"


class BusTimeoutError(BusError):
    """A request got no reply within its timeout."""

    code = "bus_timeout"
    http_status = 504


class BusNoRespondersError(BusError):
    """Nobody subscribes to the request's subject (e.g. the worker is gone)."""

    code = "no_responders"


class RemoteError(FluidPDError):
    """The responder answered with an ErrorReply; ``code`` is the responder's error code.

    ``retry_after_ms`` is set when the responder says retrying later may succeed.
    """

    def __init__(self, code: str, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.remote_message = message
        self.retry_after_ms = retry_after_ms
