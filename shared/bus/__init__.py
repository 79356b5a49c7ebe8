"""Typed NATS bus (request/reply, streams, handler wrapper) and the worker registry."""

from shared.bus.bus import Bus
from shared.bus.config import BusConfig
from shared.bus.errors import (
    BusConnectionError,
    BusError,
    BusNoRespondersError,
    BusTimeoutError,
    RemoteError,
)
from shared.bus.metrics import BusMetrics
from shared.bus.serve_handle import ServeHandle

__all__ = [
    "Bus",
    "BusConfig",
    "BusConnectionError",
    "BusError",
    "BusMetrics",
    "BusNoRespondersError",
    "BusTimeoutError",
    "RemoteError",
    "ServeHandle",
]
