"""``fluidpd bench shift`` (issue 6): automatic FluidRole on a real emulated cluster.

An open-loop arrival mix shifts phase by phase (e.g. decode-heavy → prefill-heavy →
decode-heavy) against router, workers and controller as separate processes; the controller
runs with ``--auto`` and a policy file. The bench watches what the controller publishes
(``ControllerDecision`` every interval) and what the workers publish (``StateEvent``s of
every switch, telemetry), and reports per phase the switches taken, when their pressure
first held (eq. 22 / 23 recomputed from the decision's own inputs), the decision lag in intervals and
the drain time; after the load it waits until every worker is idle and reports its free
KV blocks. Last stdout line: one JSON object (``goal_met``: the switch counts per phase are
the expected ones, no request failed, every worker ended idle with all blocks free).
What is watched: shift_observer.py; how it is read: shift_analysis.py.

Default scenario (``shift_phases``, policy ``POLICY``; the numbers are explained there):
2P2D, emulated engine with the shipped Llama-3.1-8B / A100 profile at real time, FluidToken
off; S steady mix 15 s → A decode-heavy 6 s → B prefill-heavy 10 s → C decode-heavy 6 s.
Expected: no switch in S, P→D in A, D→P in B, P→D in C. About a minute on two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from services.bench.loadgen import PlannedRequest, run_open_loop, summarize
from services.bench.shift_analysis import analyse
from services.bench.shift_observer import Observer
from services.common.cluster import Cluster
from services.common.cluster_spec import ClusterSpec
from shared.policy.config import PolicyConfig

TINY_VOCAB = 356  # the "tiny" tokenizer's vocabulary (prompt ids are drawn below it)


@dataclass(frozen=True)
class Stream:
    """Uniform (deterministic) arrivals of one request shape."""

    rate_per_s: float
    prompt_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        if self.rate_per_s <= 0 or self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError("stream rate_per_s > 0, prompt_tokens and output_tokens >= 1")


@dataclass(frozen=True)
class Phase:
    """A stretch of time with one arrival mix (one or more concurrent streams)."""

    label: str
    duration_s: float
    streams: tuple[Stream, ...]

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or not self.streams:
            raise ValueError("a phase needs duration_s > 0 and at least one stream")


@dataclass(frozen=True)
class ShiftSetup:
    """The cluster a scenario runs on. ``kv_blocks`` per worker (block size 16)."""

    prefill: int = 2
    decode: int = 2
    kv_blocks: int = 2560
    fluidtoken: bool = False
    profile: str = ""  # "" = the shipped Llama-3.1-8B / A100 profile
    extra_worker_args: tuple[str, ...] = ()
    idle_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1 or self.kv_blocks < 1 or self.idle_timeout_s <= 0:
            raise ValueError("prefill, decode, kv_blocks >= 1 and idle_timeout_s > 0")


def plan(phases: Sequence[Phase]) -> tuple[list[PlannedRequest], list[tuple[str, float, float]]]:
    """Arrivals of every phase back to back, and each phase's (label, start_s, end_s)."""
    out: list[PlannedRequest] = []
    bounds = []
    start = 0.0
    for ph in phases:
        for k, st in enumerate(ph.streams):
            offset = k / (len(ph.streams) * st.rate_per_s)  # interleave, do not coincide
            n = max(1, int(ph.duration_s * st.rate_per_s))
            out += [
                PlannedRequest(
                    start + offset + i / st.rate_per_s, st.prompt_tokens, st.output_tokens, ph.label
                )
                for i in range(n)
            ]
        bounds.append((ph.label, start, start + ph.duration_s))
        start += ph.duration_s
    return sorted(out, key=lambda p: p.arrival_s), bounds


async def _drive(
    cluster: Cluster, setup: ShiftSetup, phases: Sequence[Phase], cfg: PolicyConfig
) -> dict[str, Any]:
    requests, bounds = plan(phases)
    worker_ids = list(cluster.workers)
    async with Observer(cluster.operator_url) as obs:
        # The controller's first decision after every worker is seen: the policy is live.
        if not await obs.wait_until(
            lambda: bool(obs.decisions) and set(worker_ids) <= set(obs.telemetry), 30.0
        ):
            raise TimeoutError("no controller decision or worker telemetry within 30 s")
        t0 = time.monotonic()
        records = await run_open_loop(
            cluster.router_url, "tiny", requests, vocab_size=TINY_VOCAB, progress=False
        )
        t_load_done = time.monotonic()
        idle = await obs.wait_until(lambda: obs.idle(worker_ids), setup.idle_timeout_s)
        t_idle = time.monotonic()
        result = analyse(obs, t0, bounds, cfg)
        result["load_s"] = round(t_load_done - t0, 3)
        result["idle_after_load_s"] = round(t_idle - t_load_done, 3)
        result["idle_at_end"] = idle
        result["final"] = {
            w: {
                "role": t.role,
                "state": t.state,
                "free_blocks": t.free_blocks,
                "total_blocks": t.total_blocks,
                "migrations_out": t.metrics.get("migrations_out_total", 0.0),
                "switches": t.metrics.get("switches_total", 0.0),
                "switch_drain_ms": round(t.metrics.get("switch_drain_ms", 0.0), 1),
            }
            for w, t in sorted(obs.telemetry.items())
        }
    result["requests"] = {
        label: summarize([r for r in records if r.label == label], cfg.ttft_ms, cfg.tpot_ms)
        for label, _, _ in bounds
    }
    result["requests"]["all"] = summarize(records, cfg.ttft_ms, cfg.tpot_ms)
    result["errors_sample"] = sorted({r.error for r in records if r.error})[:5]
    return result


def run_shift(
    setup: ShiftSetup, phases: Sequence[Phase], cfg: PolicyConfig, log_dir: Path
) -> dict[str, Any]:
    """Start the cluster, drive ``phases`` through the router, analyse, stop. Blocking."""
    log_dir.mkdir(parents=True, exist_ok=True)
    policy_path = log_dir / "policy.json"
    policy_path.write_text(cfg.to_json(), encoding="utf-8")
    worker_args: tuple[str, ...] = ("--num-kv-blocks", str(setup.kv_blocks), "--block-size", "16")
    if not setup.fluidtoken:
        worker_args += ("--no-fluidtoken",)
    spec = ClusterSpec(
        prefill=setup.prefill,
        decode=setup.decode,
        model="tiny",
        engine="emulated",
        port=0,
        profile=setup.profile,
        policy_config=str(policy_path),
        auto_policy=True,
        worker_args=worker_args + setup.extra_worker_args,
        # The bench drives pressure on purpose to watch FluidRole answer it: shedding at the
        # router (docs/operations.md, "Overload") would cap the pressure and 503 requests
        # the run counts as errors.
        router_args=("--shed-ttft-multiple", "0", "--shed-decode-backlog", "0"),
        log_dir=log_dir,
    )
    cluster = Cluster(spec)
    started = time.monotonic()
    try:
        cluster.start()
        cluster.wait_ready(timeout_s=120)
        ready_s = time.monotonic() - started
        result = asyncio.run(_drive(cluster, setup, phases, cfg))
    finally:
        cluster.stop()
    result["cluster_ready_s"] = round(ready_s, 2)
    result["setup"] = asdict(setup)
    result["policy"] = cfg.to_dict()
    result["phases_planned"] = [asdict(p) for p in phases]
    return result


# ------------------------------------------------------------------------ presets
# Decision loop 4x faster than the paper's 1 s so that a test sees several switches in
# under a minute; N_persist as in PolicyConfig; the cooldown (paper-like 20 intervals) is
# longer than a decode-heavy request lives (~3-4 s here), so the tail of the previous mix
# cannot trigger a switch back; the PPI window spans 4 intervals. Thresholds: the paper's.
POLICY = PolicyConfig(decision_interval_s=0.25, n_persist=3, cooldown_s=5.0, window_s=1.0)
# Decode-heavy: each request holds ~1280 tokens of KV for ~3 s of decoding (~20 live
# requests, DPI_adm ~0.35 on two decode workers of 2560 blocks) while prefill work stays at
# ~0.7 of one prefill worker (1024 x 93.5 us = 0.11 s per prompt), so PPI stays ~0.
DECODE_HEAVY = Stream(rate_per_s=6.0, prompt_tokens=1024, output_tokens=256)
# Prefill-heavy: 3000-token prompts (0.295 s each) at 4.5/s exceed one prefill worker
# (3.4/s: its queue, hence PPI, grows without bound) but not two (6.8/s); four output
# tokens keep decode load light (a reservation lives ~0.4 s, DPI_adm ~0.1 on two workers).
PREFILL_HEAVY = Stream(rate_per_s=4.5, prompt_tokens=3000, output_tokens=4)


def shift_phases(
    steady_s: float = 15.0, decode_s: float = 6.0, prefill_s: float = 10.0
) -> list[Phase]:
    """S (a steady moderate mix; omitted when ``steady_s`` is 0), then the shift:
    A decode-heavy → B prefill-heavy → C decode-heavy.

    S carries both shapes at once: ~0.4 of two prefill workers (PPI 0–0.3) and DPI_adm
    ~0.1 on two decode workers, i.e. neither eq. 22 nor eq. 23 holds. A and C last
    6 s so that the decode load left over when B starts stays below DPI_load^high even when
    CPU contention slows decoding (at most 36 live requests over three decode workers).
    """
    steady = Phase("S", steady_s, (Stream(1.5, 1024, 128), Stream(2.0, 3000, 4)))
    return [p for p in (steady,) if steady_s > 0] + [
        Phase("A", decode_s, (DECODE_HEAVY,)),
        Phase("B", prefill_s, (PREFILL_HEAVY,)),
        Phase("C", decode_s, (DECODE_HEAVY,)),
    ]


def switch_counts(result: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per phase: {"d2p": n, "p2d": n}."""
    return {
        label: {"d2p": ph["switches_d2p"], "p2d": ph["switches_p2d"]}
        for label, ph in result["phases"].items()
    }


def expected_counts(labels: Sequence[str]) -> dict[str, dict[str, int]]:
    """What the policy should do on 2P2D: nothing in S; P→D in A (decode admission
    pressure, then 1P3D: no more, never empty a role); D→P in B; P→D again in C."""
    want = {"S": (0, 0), "A": (0, 1), "B": (1, 0), "C": (0, 1)}
    return {lb: {"d2p": want[lb][0], "p2d": want[lb][1]} for lb in labels}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fluidpd bench shift", description=__doc__)
    p.add_argument("--kv-blocks", type=int, default=ShiftSetup.kv_blocks)
    p.add_argument("--steady-s", type=float, default=15.0, help="phase S (0: skip it)")
    p.add_argument("--decode-s", type=float, default=6.0, help="phases A and C")
    p.add_argument("--prefill-s", type=float, default=10.0, help="phase B")
    p.add_argument("--log-dir", default="", help="keep the children's logs here")
    p.add_argument("--timeline", action="store_true", help="include every decision")
    a = p.parse_args(argv)
    phases = shift_phases(a.steady_s, a.decode_s, a.prefill_s)
    with tempfile.TemporaryDirectory(prefix="fluidpd-bench-shift-") as tmp:
        result = run_shift(
            ShiftSetup(kv_blocks=a.kv_blocks), phases, POLICY, Path(a.log_dir or tmp)
        )
    if not a.timeline:
        result.pop("timeline")
    counts = switch_counts(result)
    expected = expected_counts([ph.label for ph in phases])
    result.update(
        bench="shift",
        switch_counts=counts,
        expected_switch_counts=expected,
        goal_met=bool(
            counts == expected
            and result["requests"]["all"]["errors"] == 0
            and result["idle_at_end"]
            and not result["decision_seq_gaps"]
        ),
    )
    print(json.dumps(result))
    return 0
