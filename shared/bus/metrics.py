"""Prometheus metrics of the bus, registered in a caller-supplied CollectorRegistry.

Labels are bounded: ``subject`` is Subjects.pattern() (ids replaced by ``*``), ``outcome``
one of ok / invalid / error / internal_error / duplicate / forged / forged_epoch (streams) /
timeout / no_responders (client side).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True)
class BusMetrics:
    """Counters/histograms of one process's bus traffic (create once per registry)."""

    handled_total: Counter
    handler_seconds: Histogram
    stream_gap_messages_total: Counter
    requests_total: Counter
    request_seconds: Histogram
    connected: Gauge
    disconnects_total: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> BusMetrics:
        """Register the bus metrics in ``registry`` (mutates it; once per registry)."""
        return cls(
            handled_total=Counter(
                "fluidpd_bus_handled_messages_total",
                "Messages received by bus handlers/stream subscriptions, by outcome",
                ["subject", "outcome"],
                registry=registry,
            ),
            handler_seconds=Histogram(
                "fluidpd_bus_handler_seconds",
                "Time spent in one bus handler call (decode + handler + reply)",
                ["subject"],
                buckets=_LATENCY_BUCKETS_S,
                registry=registry,
            ),
            stream_gap_messages_total=Counter(
                "fluidpd_bus_stream_gap_messages_total",
                "Stream messages detected missing (sequence gaps)",
                ["subject"],
                registry=registry,
            ),
            requests_total=Counter(
                "fluidpd_bus_requests_total",
                "Requests sent on the bus, by outcome",
                ["subject", "outcome"],
                registry=registry,
            ),
            request_seconds=Histogram(
                "fluidpd_bus_request_seconds",
                "Round-trip time of bus requests",
                ["subject"],
                buckets=_LATENCY_BUCKETS_S,
                registry=registry,
            ),
            connected=Gauge(
                "fluidpd_bus_connected",
                "1 while connected to NATS, 0 otherwise",
                registry=registry,
            ),
            # A lost connection fails every in-flight stream (the router cannot tell what
            # it missed): the count shows an operator, and the tests, that one happened.
            disconnects_total=Counter(
                "fluidpd_bus_disconnects_total",
                "Times the NATS connection was lost (nats-server gone, or it dropped this "
                "client, e.g. as a slow consumer)",
                registry=registry,
            ),
        )
