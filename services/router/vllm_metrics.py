"""vLLM-named request metrics, for dashboards and autoscalers written against vLLM.

Ours (``fluidpd_router_*``) stay; these are the same observations under the names and the
``model_name`` label vLLM's OpenAI server exports (its docs, "Production Metrics"):

* ``vllm:time_to_first_token_seconds``, ``vllm:time_per_output_token_seconds`` and
  ``vllm:inter_token_latency_seconds`` (each gap between two tokens of a request),
  ``vllm:e2e_request_latency_seconds`` — histograms;
* ``vllm:num_requests_running`` (first token received, not finished) and
  ``vllm:num_requests_waiting`` (submitted, no token yet) — gauges, this router's view;
* ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total`` and
  ``vllm:request_success_total{finished_reason}`` — counters.

Times are measured at the router from the request's arrival, as ours are.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM's bucket edges for these histograms (so existing dashboards' quantiles line up).
_TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_TPOT_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


@dataclass(frozen=True)
class VllmMetrics:
    model_name: str
    ttft_seconds: Histogram
    tpot_seconds: Histogram
    inter_token_seconds: Histogram
    e2e_seconds: Histogram
    running: Gauge
    waiting: Gauge
    prompt_tokens_total: Counter
    generation_tokens_total: Counter
    success_total: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry, model_name: str) -> VllmMetrics:
        """Register the metrics in ``registry`` (mutates it; once per registry)."""
        m = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, m, buckets=buckets, registry=registry)

        return cls(
            model_name=model_name,
            ttft_seconds=hist(
                "vllm:time_to_first_token_seconds", "Time to first token", _TTFT_BUCKETS_S
            ),
            tpot_seconds=hist(
                "vllm:time_per_output_token_seconds", "Time per output token", _TPOT_BUCKETS_S
            ),
            inter_token_seconds=hist(
                "vllm:inter_token_latency_seconds", "Inter-token latency", _TPOT_BUCKETS_S
            ),
            e2e_seconds=hist(
                "vllm:e2e_request_latency_seconds", "End-to-end request latency", _E2E_BUCKETS_S
            ),
            running=Gauge(
                "vllm:num_requests_running",
                "Requests generating (first token received)",
                m,
                registry=registry,
            ),
            waiting=Gauge(
                "vllm:num_requests_waiting",
                "Requests submitted, first token not yet received",
                m,
                registry=registry,
            ),
            prompt_tokens_total=Counter(
                "vllm:prompt_tokens", "Prompt tokens processed", m, registry=registry
            ),
            generation_tokens_total=Counter(
                "vllm:generation_tokens", "Generation tokens produced", m, registry=registry
            ),
            success_total=Counter(
                "vllm:request_success",
                "Requests finished, by finish reason",
                [*m, "finished_reason"],
                registry=registry,
            ),
        )

    def submitted(self) -> None:
        self.waiting.labels(self.model_name).inc()

    def first_token(self) -> None:
        """A submitted request received its first token: waiting -> running."""
        self.waiting.labels(self.model_name).dec()
        self.running.labels(self.model_name).inc()

    def finished(
        self,
        arrival_s: float,
        end_s: float,
        receive_times_s: list[float],
        prompt_tokens: int,
        finish_reason: str | None,
    ) -> None:
        """Record one ended request (``receive_times_s`` empty: it never got a token)."""
        name = self.model_name
        (self.running if receive_times_s else self.waiting).labels(name).dec()
        self.prompt_tokens_total.labels(name).inc(prompt_tokens)
        self.generation_tokens_total.labels(name).inc(len(receive_times_s))
        if finish_reason in ("stop", "length"):
            self.success_total.labels(name, finish_reason).inc()
            self.e2e_seconds.labels(name).observe(max(0.0, end_s - arrival_s))
        if not receive_times_s:
            return
        self.ttft_seconds.labels(name).observe(max(0.0, receive_times_s[0] - arrival_s))
        for prev, cur in itertools.pairwise(receive_times_s):
            gap = max(0.0, cur - prev)
            self.tpot_seconds.labels(name).observe(gap)
            self.inter_token_seconds.labels(name).observe(gap)
