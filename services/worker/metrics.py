"""Worker metrics on Prometheus (``fluidpd_worker_*``), in the runtime's own registry.

Gauges are refreshed from live state at each telemetry tick; histograms are observed where
the work happens (TTFT stages, step times). Served on ``--metrics-port`` at ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from services.worker.stats import DecodeStats, PrefillStats, PressureSignals, SwitchStats
from shared.policy.predictors import TIME_COEFFICIENTS, LatencyProfile
from shared.policy.roles import ROLES, SERVING_STATES, Role, WorkerState

# TTFT breakdown: where a request's time to first token goes, stage by stage.
TTFT_STAGES = (
    "queue_wait",
    "decode_admission",
    "prefill_compute",
    "kv_export",
    "transfer_queue",
    "copy",
    "validation",
)
_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, worker_id: str) -> None:
        self.worker_id = worker_id
        w = ["worker"]
        self.ttft_stage = Histogram(
            "fluidpd_worker_ttft_stage_seconds",
            "Time spent in each TTFT stage",
            ["worker", "stage"],
            buckets=_BUCKETS_S,
            registry=registry,
        )
        self.step = Histogram(
            "fluidpd_worker_step_seconds",
            "Engine step wall time",
            ["worker", "kind"],
            buckets=_BUCKETS_S,
            registry=registry,
        )
        self.predictor_error = Gauge(
            "fluidpd_worker_predictor_relative_error",
            "|predicted - measured| / measured of the last step",
            ["worker", "predictor"],
            registry=registry,
        )
        self.coefficient = Gauge(
            "fluidpd_worker_profile_coefficient",
            "Online-recalibrated latency profile coefficients",
            ["worker", "name"],
            registry=registry,
        )
        self.role = Gauge(
            "fluidpd_worker_role",
            "1 for the worker's current role",
            ["worker", "role"],
            registry=registry,
        )
        self.state = Gauge(
            "fluidpd_worker_state",
            "1 for the worker's current state",
            ["worker", "state"],
            registry=registry,
        )
        self.ppi = Gauge(
            "fluidpd_worker_ppi", "Prefill Pressure Index (eq. 5)", w, registry=registry
        )
        self.dpi_load = Gauge("fluidpd_worker_dpi_load", "DPI_load (eq. 7)", w, registry=registry)
        self.dpi_adm = Gauge("fluidpd_worker_dpi_adm", "DPI_adm (eq. 8)", w, registry=registry)
        self.steal_budget = Gauge(
            "fluidpd_worker_steal_budget_tokens",
            "Advertised per-prefill steal budget (eq. 17)",
            w,
            registry=registry,
        )
        self.kv_free = Gauge(
            "fluidpd_worker_kv_free_blocks", "Free KV blocks", w, registry=registry
        )
        self.kv_total = Gauge("fluidpd_worker_kv_total_blocks", "KV blocks", w, registry=registry)
        self.kv_reserved = Gauge(
            "fluidpd_worker_kv_reserved_blocks", "Reserved KV blocks", w, registry=registry
        )
        self.queue_len = Gauge(
            "fluidpd_worker_queue_length", "Prefill queue length", w, registry=registry
        )
        self.running = Gauge(
            "fluidpd_worker_running_requests", "Runnable decode requests", w, registry=registry
        )
        self.stolen = Gauge(
            "fluidpd_worker_stolen_tokens_total",
            "Suffix tokens computed here for other workers (FluidToken)",
            w,
            registry=registry,
        )
        self.handed_off = Gauge(
            "fluidpd_worker_handed_off_tokens_total",
            "Prompt tokens handed to decode workers (FluidToken)",
            w,
            registry=registry,
        )
        self.splits = Gauge(
            "fluidpd_worker_split_requests_total", "Requests split here", w, registry=registry
        )
        self.refused = Gauge(
            "fluidpd_worker_refused_steals_total",
            "Steals refused by the decode-side budget re-check",
            w,
            registry=registry,
        )
        self.switches = Gauge(
            "fluidpd_worker_switches_total", "Completed role switches", w, registry=registry
        )
        self.requests = Counter(
            "fluidpd_worker_requests_total",
            "Requests finished here",
            ["worker", "outcome"],
            registry=registry,
        )

    def observe_stage(self, stage: str, seconds: float) -> None:
        self.ttft_stage.labels(self.worker_id, stage).observe(max(0.0, seconds))

    def observe_step(self, kind: str, seconds: float) -> None:
        """One engine step of ``kind`` (prefill | decode | mixed)."""
        self.step.labels(self.worker_id, kind).observe(seconds)

    def set_predictor_error(self, predictor: str, relative_error: float) -> None:
        self.predictor_error.labels(self.worker_id, predictor).set(relative_error)

    def refresh(
        self,
        role: Role,
        state: WorkerState,
        signals: PressureSignals,
        profile: LatencyProfile,
        decode: DecodeStats,
        prefill: PrefillStats,
        switch: SwitchStats,
    ) -> None:
        """Set every gauge from the given snapshots (before a scrape)."""
        wid = self.worker_id
        for r in ROLES:
            self.role.labels(wid, r).set(1 if role == r else 0)
        for st in SERVING_STATES:
            self.state.labels(wid, st).set(1 if state == st else 0)
        self.ppi.labels(wid).set(signals.ppi)
        self.dpi_load.labels(wid).set(signals.dpi_load)
        self.dpi_adm.labels(wid).set(signals.dpi_adm)
        self.steal_budget.labels(wid).set(signals.steal_budget_tokens)
        pool = decode.pool
        self.kv_free.labels(wid).set(pool.free_blocks)
        self.kv_total.labels(wid).set(pool.usable_blocks)
        self.kv_reserved.labels(wid).set(pool.reserved_blocks)
        self.queue_len.labels(wid).set(prefill.queue_len)
        self.running.labels(wid).set(decode.num_running)
        self.stolen.labels(wid).set(decode.stolen_tokens_total)
        self.handed_off.labels(wid).set(prefill.handed_off_tokens_total)
        self.splits.labels(wid).set(prefill.split_requests_total)
        self.refused.labels(wid).set(decode.refused_steals_total)
        self.switches.labels(wid).set(switch.switches_total)
        for name in TIME_COEFFICIENTS:
            self.coefficient.labels(wid, name).set(getattr(profile, name))


async def start_metrics_server(
    registry: CollectorRegistry,
    host: str,
    port: int,
    before_scrape: Callable[[], None] = lambda: None,
) -> web.AppRunner:
    """Serve ``/metrics`` for ``registry``; ``before_scrape`` refreshes gauges first.
    Returns the runner (``await runner.cleanup()``)."""

    async def metrics(_: web.Request) -> web.Response:
        before_scrape()
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
