"""Automatic FluidRole with the real ``tiny`` torch engine (issue 6): 2P2D tiny workers,
router and controller as separate processes, the controller on ``--auto`` with a test
policy file, continuous load through the router's HTTP API (greedy, ignore_eos):

  A   6 s  decode-heavy, closed loop (20 clients, 16-token prompts, 200 out) → automatic P→D
  B  10 s  prefill-heavy, open loop (bursts of 6 x 600-token prompts every 0.8 s, 2 out)
           → automatic D→P

Shown on one run (module fixture, read by both tests): at least one automatic P→D (in A)
and then one automatic D→P (in B), each Drain → Switch → Active (``ControllerDecision`` and
the worker's ``StateEvent``s, via ``services.bench.shift_observer.Observer`` /
``services.bench.shift_analysis.analyse``); zero failed requests; every output equal to
``shared.engine.generate.generate`` on a local tiny Engine (same prompts and max_tokens,
greedy); every worker ends idle with free_blocks ==
total_blocks; every switched worker kept its process id (the telemetry ``pid`` before, after
and the child the cluster started are one number; no child exited).

Test policy (not the product defaults): decision interval 0.25 s, N_persist 2, cooldown
3 s, PPI window 1 s; thresholds are the paper's (PPI_low 0.6, PPI_high 1.0, DPI_load^high
0.6, DPI_adm^high 0.2) but the TTFT SLO is 150 ms instead of 2000 ms. Why: PPI_i = queued
prefill work / time left to the TTFT deadline (eq. 4) and tiny prefills 600 tokens in
~26 ms on one thread (cpu-tiny profile, refitted online), so with 2 s PPI > 1 would need
~80 long prompts queued on one worker, which two shared cores cannot push through the
router; the torch engine has no ``--time-scale``, so the SLO scales the same equation
instead. Bursts (not uniform arrivals) make the queue real: a burst of 6 needs ~160 ms of
one prefill worker (> 150 ms budget) but ~80 ms of two. Phase A is closed loop so that its
live KV, hence DPI_adm, does not depend on how fast this machine decodes (an open-loop
rate gave DPI_adm 0.14-0.5 from run to run); 20 x 216 tokens at most cannot exhaust the
pools. FluidToken is off (``--no-fluidtoken``) so that decode workers do not absorb prompt
work and blur prefill pressure. KV: 1024 blocks of 4 tokens per worker.

Outputs are compared as text (the router's OpenAI API returns text, not ids): reference ids
are detokenized as the router does (``IncrementalDetokenizer`` seeded with the prompt), and
``completion_tokens`` must equal ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from services.bench.loadgen import prompt_ids
from services.bench.shift import TINY_VOCAB
from services.bench.shift_analysis import analyse
from services.bench.shift_observer import Observer
from services.common.cluster import Cluster
from services.common.cluster_spec import ClusterSpec
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.generate import generate
from shared.policy.config import PolicyConfig
from shared.policy.fluidrole import D2P, P2D
from shared.sampling_params import SamplingParams
from shared.tokenizer.detokenizer import IncrementalDetokenizer
from shared.tokenizer.models import load_tokenizer

pytestmark = pytest.mark.timeout(300)

POLICY = PolicyConfig(
    ttft_ms=150.0,
    decision_interval_s=0.25,
    n_persist=2,
    cooldown_s=3.0,
    reverse_wait_s=3.0,  # the ADAPTIVE rules' wait before moving back (cooldown_s: PAPER's)
    window_s=1.0,
    settle_s=1.5,  # the ADAPTIVE rules' same-way wait, on this test's compressed clock
)
# Decode-heavy, closed loop: CLIENTS clients each send up to PER_CLIENT requests back to
# back (16-token prompt, DECODE_OUT tokens) for A_S seconds. A fixed concurrency keeps the
# live KV (hence DPI_adm) at the same level whatever the machine's decode speed: ~10 live
# requests of 16..216 tokens per decode worker ≈ 0.25-0.5 of 4096 tokens, and at most
# 20 x 216 tokens in all, far from exhausting any pool.
A_S, CLIENTS, PER_CLIENT, DECODE_OUT = 6.0, 20, 8, 200
# Prefill-heavy, open loop: a burst of BURST 600-token prompts (2 tokens out) every
# BURST_EVERY_S for B_S seconds; one prefill worker needs ~BURST x 26 ms (uncontended) to
# clear a burst, more than the 150 ms TTFT budget, so PPI > 1 on each burst; two share it.
B_S, BURST, BURST_EVERY_S, PREFILL_PROMPT = 10.0, 6, 0.8, 600
B_INDEX0 = 10_000  # prompt indices of phase B (A uses client * PER_CLIENT + k)
BOUNDS = [("A", 0.0, A_S), ("B", A_S, A_S + B_S)]


WORKER_ARGS = ("--num-kv-blocks", "1024", "--block-size", "4", "--no-fluidtoken")
REQUEST_TIMEOUT_S = 120.0
IDLE_TIMEOUT_S = 60.0


async def _complete(
    session: aiohttp.ClientSession, url: str, index: int, label: str, prompt: int, out_n: int
) -> dict[str, Any]:
    """One non-streaming completion; the outcome as a dict (never raises)."""
    body = {
        "model": "tiny",
        "prompt": prompt_ids(index, prompt, TINY_VOCAB),
        "max_tokens": out_n,
        "temperature": 0,
        "ignore_eos": True,
    }
    out: dict[str, Any] = {
        "index": index,
        "label": label,
        "prompt_tokens": prompt,
        "max_tokens": out_n,
        "status": 0,
        "error": None,
    }
    try:
        async with session.post(
            f"{url}/v1/completions",
            json=body,
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
        ) as resp:
            out["status"] = resp.status
            doc = await resp.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:200]
        return out
    if out["status"] != 200 or "choices" not in doc:
        out["error"] = str(doc)[:200]
        return out
    out["text"] = doc["choices"][0]["text"]
    out["completion_tokens"] = doc["usage"]["completion_tokens"]
    return out


async def _load(url: str) -> list[dict[str, Any]]:
    """Phase A closed loop, then phase B's bursts at their scheduled times; every outcome."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.monotonic()

        async def client(c: int) -> list[dict[str, Any]]:
            done = []
            for k in range(PER_CLIENT):
                if time.monotonic() - t0 >= A_S:
                    break
                i = c * PER_CLIENT + k
                done.append(await _complete(session, url, i, "A", 16, DECODE_OUT))
            return done

        clients = [asyncio.ensure_future(client(c)) for c in range(CLIENTS)]
        bursts = []
        for k in range(int(B_S / BURST_EVERY_S)):
            delay = A_S + k * BURST_EVERY_S - (time.monotonic() - t0)
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival schedule itself, not a sync
            bursts += [
                asyncio.ensure_future(
                    _complete(session, url, B_INDEX0 + k * BURST + j, "B", PREFILL_PROMPT, 2)
                )
                for j in range(BURST)
            ]
        outcomes = [o for got in await asyncio.gather(*clients) for o in got]
        return outcomes + list(await asyncio.gather(*bursts))


async def _drive(cluster: Cluster) -> Any:
    ids = list(cluster.workers)
    async with Observer(cluster.operator_url) as obs:
        ready = await obs.wait_until(
            lambda: bool(obs.decisions) and set(ids) <= set(obs.telemetry), 60.0
        )
        assert ready, "no controller decision or worker telemetry within 60 s"
        pids_start = {w: int(obs.telemetry[w].metrics["pid"]) for w in ids}
        t0 = time.monotonic()
        outcomes = await _load(cluster.router_url)
        load_s = time.monotonic() - t0
        idle = await obs.wait_until(lambda: obs.idle(ids), IDLE_TIMEOUT_S)
        result = analyse(obs, t0, BOUNDS, POLICY)
        result.pop("timeline")
        result.update(load_s=round(load_s, 2), idle_at_end=idle, pids_start=pids_start)
        result["final"] = {
            w: {
                "role": t.role,
                "state": t.state,
                "free_blocks": t.free_blocks,
                "total_blocks": t.total_blocks,
                "pid": int(t.metrics["pid"]),
                "switches": t.metrics.get("switches_total", 0.0),
                "migrations_out": t.metrics.get("migrations_out_total", 0.0),
            }
            for w, t in sorted(obs.telemetry.items())
        }
    return outcomes, result


def _reference_texts(outcomes: Sequence[dict[str, Any]]) -> list[str]:
    """What a run without switches produces for each request sent: a local tiny Engine,
    greedy, ignore_eos, the same prompt and max_tokens."""
    engine = Engine.load(EngineConfig(model="tiny", block_size=4, num_kv_blocks=8192))
    tokenizer = load_tokenizer("tiny")
    prompts = [prompt_ids(o["index"], o["prompt_tokens"], TINY_VOCAB) for o in outcomes]
    params = [SamplingParams(max_tokens=o["max_tokens"], ignore_eos=True) for o in outcomes]
    texts = []
    for prompt, out in zip(prompts, generate(engine, prompts, params), strict=True):
        detok = IncrementalDetokenizer(tokenizer, prompt)
        texts.append(detok.push_many(list(out.token_ids)) + detok.flush())
    return texts


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    log_dir: Path = tmp_path_factory.mktemp("fluidrole-auto-tiny")
    policy_path = log_dir / "policy.json"
    policy_path.write_text(POLICY.to_json(), encoding="utf-8")
    spec = ClusterSpec(
        prefill=2,
        decode=2,
        model="tiny",
        engine="torch",
        port=0,
        threads=1,
        policy_config=str(policy_path),
        auto_policy=True,
        worker_args=WORKER_ARGS,
        log_dir=log_dir,
    )
    cluster = Cluster(spec)
    started = time.monotonic()
    try:
        cluster.start()
        cluster.wait_ready(timeout_s=120)
        ready_s = time.monotonic() - started
        child_pids = {w: c.pid for w, c in cluster.workers.items()}
        outcomes, result = asyncio.run(_drive(cluster))
        exited = [c.name for c in cluster.exited_children()]
    finally:
        cluster.stop()
    t_ref = time.monotonic()
    result["reference"] = _reference_texts(outcomes)
    result.update(
        outcomes=outcomes,
        child_pids=child_pids,
        exited=exited,
        cluster_ready_s=round(ready_s, 2),
        reference_s=round(time.monotonic() - t_ref, 2),
    )
    (log_dir / "result.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(f"\nlogs and result.json: {log_dir}; ready {ready_s:.1f} s, load {result['load_s']} s")
    for s in result["switches"]:
        print(
            f"switch {s['action']} {s['worker_id']} in {s['phase']}: decided {s['decided_s']} s, "
            f"drain {s['drain_s']} s, active {s['active_s']} s, completed {s['completed']}"
        )
    for label, ph in result["phases"].items():
        print(
            f"phase {label}: max PPI̅ {ph['max_ppi_bar']}, max DPI̅_load "
            f"{ph['max_dpi_load_bar']}, max DPI̅_adm {ph['max_dpi_adm_bar']}, "
            f"reasons {ph['reasons']}"
        )
    return result


def test_automatic_switches_both_ways_with_real_tiny(run: dict[str, Any]) -> None:
    switches = run["switches"]
    p2d = [s for s in switches if s["action"] == P2D]
    d2p = [s for s in switches if s["action"] == D2P]
    assert p2d and d2p, switches
    # Back and forth: a P→D in the decode-heavy phase, then a D→P in the prefill-heavy one.
    assert p2d[0]["phase"] == "A" and any(s["phase"] == "B" for s in d2p), switches
    assert p2d[0]["decided_s"] < next(s for s in d2p if s["phase"] == "B")["decided_s"]
    for s in switches:
        assert s["completed"], s  # Drain → Switch → Active, not cancelled
    assert run["cancelled_switches"] == 0
    # The switched workers are the same processes: the pid each reports is the child the
    # cluster started, before and after, and no child exited.
    assert run["exited"] == []
    for wid in {s["worker_id"] for s in switches}:
        assert run["final"][wid]["switches"] >= 1, run["final"][wid]
        assert run["pids_start"][wid] == run["final"][wid]["pid"] == run["child_pids"][wid]


def test_no_failed_request_identical_outputs_no_leak(run: dict[str, Any]) -> None:
    outcomes, reference = run["outcomes"], run["reference"]
    labels = [o["label"] for o in outcomes]
    assert labels.count("A") >= CLIENTS and labels.count("B") == int(B_S / BURST_EVERY_S) * BURST
    failed = [o for o in outcomes if o["error"] is not None or o["status"] != 200]
    assert failed == [], failed[:5]
    for o, want in zip(outcomes, reference, strict=True):
        assert o["completion_tokens"] == o["max_tokens"], o
        assert o["text"] == want, (o["index"], o["label"])
    # Every worker ends Active and idle with every KV block back in its free pool.
    assert run["idle_at_end"], run["final"]
    for wid, w in run["final"].items():
        assert w["state"] == "active" and w["free_blocks"] == w["total_blocks"], (wid, w)
