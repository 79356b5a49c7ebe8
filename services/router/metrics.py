"""Prometheus metrics of one router, in a per-router CollectorRegistry (never the global).

Labels are bounded: ``endpoint`` is one of the routes, ``status`` an HTTP status code,
``code`` an error code from shared.errors / the router / the workers.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.router.vllm_metrics import VllmMetrics

_TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True)
class RouterMetrics:
    requests_total: Counter
    errors_total: Counter
    in_flight: Gauge
    ttft_seconds: Histogram
    tpot_seconds: Histogram
    inter_token_seconds: Histogram
    prompt_tokens_total: Counter
    completion_tokens_total: Counter
    submit_retries_total: Counter
    foreign_token_items_total: Counter
    unauthorized_total: Counter
    stream_hold_expired_total: Counter
    vllm: VllmMetrics  # the same observations under vLLM's names (vllm_metrics.py)

    @classmethod
    def create(cls, registry: CollectorRegistry, model_name: str = "") -> RouterMetrics:
        """Register the router metrics in ``registry`` (mutates it; once per registry)."""
        p = "fluidpd_router_"
        return cls(
            vllm=VllmMetrics.create(registry, model_name),
            requests_total=Counter(
                p + "requests_total",
                "HTTP requests by endpoint and status",
                ["endpoint", "status"],
                registry=registry,
            ),
            errors_total=Counter(
                p + "errors_total", "Failed requests by error code", ["code"], registry=registry
            ),
            in_flight=Gauge(
                p + "requests_in_flight", "Generation requests in progress", registry=registry
            ),
            ttft_seconds=Histogram(
                p + "ttft_seconds",
                "Time to first token (router arrival to first token received)",
                buckets=_TTFT_BUCKETS_S,
                registry=registry,
            ),
            tpot_seconds=Histogram(
                p + "tpot_seconds",
                "Mean time per output token after the first, per request",
                buckets=_TOKEN_BUCKETS_S,
                registry=registry,
            ),
            inter_token_seconds=Histogram(
                p + "inter_token_seconds",
                "Time between two consecutive tokens of a request",
                buckets=_TOKEN_BUCKETS_S,
                registry=registry,
            ),
            prompt_tokens_total=Counter(
                p + "prompt_tokens_total", "Prompt tokens submitted", registry=registry
            ),
            completion_tokens_total=Counter(
                p + "completion_tokens_total", "Completion tokens returned", registry=registry
            ),
            submit_retries_total=Counter(
                p + "submit_retries_total", "Submissions retried on another pair", registry=registry
            ),
            foreign_token_items_total=Counter(
                p + "foreign_token_items_total",
                "Token items dropped: sent by a worker not serving the request",
                registry=registry,
            ),
            unauthorized_total=Counter(
                p + "unauthorized_total",
                "API requests refused: no or wrong API key",
                registry=registry,
            ),
            stream_hold_expired_total=Counter(
                p + "stream_hold_expired_total",
                "Streams whose 200 went out before their first token: the header hold ran out",
                registry=registry,
            ),
        )

    def observe_tokens(self, arrival_s: float, receive_times_s: list[float]) -> None:
        """Record TTFT / TPOT / inter-token latencies of one finished request."""
        if not receive_times_s:
            return
        self.ttft_seconds.observe(max(0.0, receive_times_s[0] - arrival_s))
        for prev, cur in itertools.pairwise(receive_times_s):
            self.inter_token_seconds.observe(max(0.0, cur - prev))
        if len(receive_times_s) > 1:
            span = receive_times_s[-1] - receive_times_s[0]
            self.tpot_seconds.observe(max(0.0, span / (len(receive_times_s) - 1)))
