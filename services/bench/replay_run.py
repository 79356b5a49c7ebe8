"""One replay run of ``fluidpd bench replay``: start a fresh cluster for one configuration,
sample its telemetry, send the workload open-loop, measure, stop, write the files.

Configurations → cluster (mirrors the simulator's ``config_for``): ``static`` — router
``--pairing round_robin``, workers ``--no-fluidtoken``, controller ``--no-auto``; ``token`` —
pressure pairing, FluidToken on, ``--no-auto``; ``role`` — pressure pairing, workers
``--no-fluidtoken``, controller ``--auto``; ``full`` — FluidToken on and ``--auto``;
``static-pressure`` — like static but pressure pairing (pairing's share of the gain);
``static-paper`` — the paper's own baseline: static with no door (router shedding off) and
queued work dropped 60 s (trace time) after arrival, whatever the spec's shedding fields say.
With ``paper_rules`` the workers also drain by waiting (``--no-migrate``, the paper's D→P).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.bench.loadgen import PlannedRequest, run_open_loop
from services.bench.replay_metrics import (
    CpuMeter,
    attainment,
    bottleneck,
    p95_ttft_series,
    record_json,
)
from services.bench.replay_telemetry import TelemetrySampler, to_trace_time
from services.common.cluster import Cluster
from services.common.cluster_spec import ClusterSpec
from shared.policy.admission import (
    DEFAULT_DECODE_BACKLOG_BATCHES,
    DEFAULT_EXPIRE_MARGIN_S,
    DEFAULT_TTFT_MULTIPLE,
    STREAM_HOLD_SLACK_S,
    paper_baseline_shedding,
)

FLUIDTOKEN = {
    "static": False,
    "static-pressure": False,
    "static-paper": False,
    "token": True,
    "role": False,
    "full": True,
}
FLUIDROLE = {**{name: False for name in FLUIDTOKEN}, "role": True, "full": True}
ROUND_ROBIN = ("static", "static-paper")


@dataclass(frozen=True)
class RunSpec:
    """One run. ``prefill`` is the initial number of prefill workers (the rest decode).
    ``slo_*_ms`` are trace-time SLOs; the run compares real latencies with SLO × time_scale.
    """

    config: str
    workers: int = 8
    prefill: int = 4
    engine: str = "emulated"
    model: str = "tiny"
    profile_path: str = ""
    policy_path: str = ""
    time_scale: float = 1.0
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 100.0
    out_dir: Path = field(default_factory=lambda: Path("."))
    url: str = ""
    rps: float = 0.0
    tag: str = ""
    timeout_s: float = 600.0
    ready_timeout_s: float = 300.0
    max_num_seqs: int = 64
    # Overload (docs/operations.md): the router's shedding multiple (0: off) and the prefill
    # workers' expiry margin in trace seconds (< 0: off). Defaults are the routers' and the
    # simulator's own, so a RunSpec built without them (crosscheck) matches the sim side.
    shed_ttft_multiple: float = DEFAULT_TTFT_MULTIPLE
    shed_decode_backlog: float = DEFAULT_DECODE_BACKLOG_BATCHES
    expire_margin_s: float = DEFAULT_EXPIRE_MARGIN_S
    paper_rules: bool = False  # the policy file says rules=paper: drain by waiting

    def __post_init__(self) -> None:
        if self.config not in FLUIDTOKEN and not (self.url and self.config == "external"):
            raise ValueError(f"unknown config {self.config!r}")
        if not 1 <= self.prefill < self.workers:
            raise ValueError("prefill must be in [1, workers)")
        if not self.time_scale > 0:
            raise ValueError("time_scale must be > 0")

    @property
    def name(self) -> str:
        return f"{self.tag or self.config}-{self.rps:g}"


def cluster_spec(spec: RunSpec) -> ClusterSpec:
    """The ClusterSpec of ``spec``'s configuration (module doc)."""
    worker_args: tuple[str, ...] = ("--max-num-seqs", str(spec.max_num_seqs))
    if not FLUIDTOKEN[spec.config]:
        worker_args += ("--no-fluidtoken",)
    ttft_multiple, decode_backlog, margin_trace_s = _shedding(spec)
    margin = margin_trace_s * spec.time_scale if margin_trace_s >= 0 else -1.0
    worker_args += ("--expire-margin-s", f"{margin:g}")
    if spec.paper_rules:
        worker_args += ("--no-migrate",)
    router_args: tuple[str, ...] = ("--ttft-slo-ms", f"{spec.slo_ttft_ms * spec.time_scale:g}")
    router_args += ("--shed-ttft-multiple", f"{ttft_multiple:g}")
    router_args += ("--shed-decode-backlog", f"{decode_backlog:g}")
    if margin >= 0:
        # A stream's headers wait past the (scaled) expiry, so a drop is a 503 (rejected),
        # not an in-band error: the router's automatic hold assumes the default margin. The
        # slack beyond it is the router's own, in trace seconds.
        hold_s = (spec.slo_ttft_ms / 1000.0 + STREAM_HOLD_SLACK_S) * spec.time_scale + margin
        router_args += ("--stream-header-hold-s", f"{hold_s:g}")
    if spec.config in ROUND_ROBIN:
        router_args += ("--pairing", "round_robin")
    return ClusterSpec(
        prefill=spec.prefill,
        decode=spec.workers - spec.prefill,
        model=spec.model,
        engine=spec.engine,
        port=0,
        profile=spec.profile_path,
        policy_config=spec.policy_path,
        auto_policy=FLUIDROLE[spec.config],
        worker_args=worker_args,
        router_args=router_args,
        log_dir=spec.out_dir / "logs" / spec.name,
        die_with_parent=True,
    )


def _shedding(spec: RunSpec) -> tuple[float, float, float]:
    """(router TTFT multiple, router decode-backlog batches, expiry margin in trace s) of
    ``spec``: its own fields, except ``static-paper``, whose baseline fixes all three."""
    if spec.config != "static-paper":
        return spec.shed_ttft_multiple, spec.shed_decode_backlog, spec.expire_margin_s
    paper = paper_baseline_shedding(spec.slo_ttft_ms / 1000.0)
    margin_s = paper.expire_margin_s if paper.expire_margin_s is not None else -1.0
    return paper.ttft_multiple, paper.decode_backlog_batches, margin_s


def _vocab_size(model: str) -> int:
    from shared.tokenizer.models import load_tokenizer

    return int(load_tokenizer(model).vocab_size)


def run_once(spec: RunSpec, plan: list[PlannedRequest]) -> dict[str, Any]:
    """Run ``plan`` against a fresh cluster (or ``spec.url``); write
    ``requests-<name>.jsonl`` and ``run-<name>.json`` into ``spec.out_dir``; return the row.

    Raises ClusterStartError when the cluster does not come up."""
    cluster = None if spec.url else Cluster(cluster_spec(spec))
    sampler: TelemetrySampler | None = None
    try:
        url = spec.url
        pids: dict[str, int] = {}
        if cluster is not None:
            cluster.start()
            cluster.wait_ready(timeout_s=spec.ready_timeout_s)
            url = cluster.router_url
            pids = {k: v for k, v in cluster.pids().items() if k in ("router", "nats")}
            sampler = TelemetrySampler(spec.out_dir / f"telemetry-{spec.name}.json")
            sampler.start(cluster.operator_url)
        meter = CpuMeter(pids)
        t0 = time.monotonic()
        records = asyncio.run(
            run_open_loop(
                url, spec.model, plan, vocab_size=_vocab_size(spec.model), timeout_s=spec.timeout_s
            )
        )
        cpu = meter.read()
        telemetry = sampler.stop() if sampler is not None else {}
        sampler = None
    finally:
        if sampler is not None:
            sampler.stop(2.0)
        if cluster is not None:
            cluster.stop()
    s = spec.time_scale
    ttft_ms, tpot_ms = spec.slo_ttft_ms * s, spec.slo_tpot_ms * s
    row = attainment(records, ttft_ms, tpot_ms)
    tel = to_trace_time(telemetry, t0, s) if telemetry else {"series": {}, "switch_log": []}
    stolen = tel["series"].get("stolen_tokens_total") or [0.0]
    row.update(
        config=spec.config,
        rps=spec.rps,
        initial_split=f"{spec.prefill}P{spec.workers - spec.prefill}D",
        stolen_tokens=int(stolen[-1]),
        switches=len(tel["switch_log"]),
        wall_s=cpu["wall_s"],
        loadgen_bottleneck=bottleneck(records, cpu, ttft_ms, s),
    )
    records_path = spec.out_dir / f"requests-{spec.name}.jsonl"
    with records_path.open("w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(record_json(rec, s)) + "\n")
    row["records"] = str(records_path)
    doc = {
        "label": spec.config,
        "summary": {k: v for k, v in row.items() if k != "records"},
        "switch_log": tel["switch_log"],
        "series": {**tel["series"], "p95_ttft_ms_by_arrival_s": p95_ttft_series(records, s)},
        "time_scale": s,
    }
    (spec.out_dir / f"run-{spec.name}.json").write_text(json.dumps(doc) + "\n", encoding="utf-8")
    return row
