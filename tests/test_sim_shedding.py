"""Simulator: SLO-aware shedding at the router and expiry of queued prefill work use the
live defaults (SheddingConfig), are counted as not attained and reported separately, and
the simulator reserves KV by the worker's formula."""

from __future__ import annotations

import dataclasses
import math

import pytest

from services.sim import SimConfig, Simulation, config_for
from services.sim.config import SimConfigError
from shared.engine.profiles import load_profile
from shared.policy.admission import (
    DEFAULT_DECODE_BACKLOG_BATCHES,
    PAPER_ABORT_AFTER_S,
    SheddingConfig,
)
from shared.policy.pressure import admission_kv_tokens
from shared.trace_request import TraceRequest

PROFILE = load_profile()
TTFT_S, TPOT_S = 2.0, 0.1


def flood(n: int = 60, prompt: int = 6000) -> list[TraceRequest]:
    # n long prompts within 60 ms on 1P1D: ~0.58 s of prefill each.
    return [TraceRequest(i / 1000.0, prompt, 4, "x") for i in range(n)]


def test_router_sheds_what_cannot_meet_twice_the_ttft_slo() -> None:
    cfg = config_for("static", SimConfig(workers=2))
    assert cfg.shedding == SheddingConfig()  # the live defaults
    sim = Simulation(flood(), cfg, PROFILE)
    res = sim.run()
    t_pre = PROFILE.prefill_time_s(6000)
    # Arrival i sees i prefills ahead (all still queued or running): predicted (i+1)·T_pre.
    accepted = math.floor(cfg.shedding.ttft_multiple * TTFT_S / t_pre)
    s = res.summary(TTFT_S, TPOT_S)
    assert s["rejected"] == 60 - accepted
    assert s["expired"] == 0 and s["failed"] == 0
    assert all(r.t_first > 0 for r in sim.reqs if not r.rejected)  # accepted ones complete
    assert all(r.t_first < 0 for r in sim.reqs if r.rejected)  # nothing computed for those
    assert s["joint_attainment"] <= accepted / 60  # rejected count as not attained


def test_queued_work_past_deadline_plus_margin_is_dropped() -> None:
    shed = SheddingConfig(ttft_multiple=0.0, expire_margin_s=5.0)  # no door check
    sim = Simulation(flood(), config_for("static", SimConfig(workers=2, shedding=shed)), PROFILE)
    res = sim.run()
    s = res.summary(TTFT_S, TPOT_S)
    t_pre = PROFILE.prefill_time_s(6000)
    # A request reaching the head after arrival + 2 s + 5 s is dropped without prefill.
    started = 60 - s["expired"]
    assert abs(started - (math.ceil(7.0 / t_pre) + 1)) <= 1
    assert s["rejected"] == 0 and s["failed"] == 0
    assert all(r.t_first < 0 for r in sim.reqs if r.expired)
    for w in sim.workers:  # nothing left reserved or queued
        assert (w.held_blocks, w.reserved_blocks, w.requests) == (0, 0, 0) and not w.queue


def test_router_sheds_while_every_decode_worker_has_a_batch_waiting() -> None:
    # 3P1D, a decode batch of 2: long decodes fill it, the 3 prefill heads then wait for
    # its admission (3 >= 1 batch of 2), and the router's decode-backlog rule sheds.
    trace = [TraceRequest(i * 0.05, 200, 3000, "x") for i in range(40)]
    base = SimConfig(workers=4, prefill_workers=3, max_num_seqs=2)
    only_backlog = SheddingConfig(ttft_multiple=0.0, expire_margin_s=None)
    assert only_backlog.decode_backlog_batches == DEFAULT_DECODE_BACKLOG_BATCHES  # live's
    sim = Simulation(
        trace, config_for("static", dataclasses.replace(base, shedding=only_backlog)), PROFILE
    )
    s = sim.run().summary(TTFT_S, TPOT_S)
    assert s["rejected"] > 0
    assert all(r.t_first < 0 for r in sim.reqs if r.rejected)  # nothing computed for those
    off = dataclasses.replace(only_backlog, decode_backlog_batches=0.0)
    s_off = Simulation(
        trace, config_for("static", dataclasses.replace(base, shedding=off)), PROFILE
    ).run()
    assert s_off.summary(TTFT_S, TPOT_S)["rejected"] == 0


def test_shedding_off_serves_everything() -> None:
    off = SheddingConfig(ttft_multiple=0.0, expire_margin_s=None, decode_backlog_batches=0.0)
    res = Simulation(
        flood(), config_for("static", SimConfig(workers=2, shedding=off)), PROFILE
    ).run()
    s = res.summary(TTFT_S, TPOT_S)
    assert (s["rejected"], s["expired"], s["failed"]) == (0, 0, 0)


def test_simulated_reservation_is_the_workers_formula() -> None:
    cfg = SimConfig(workers=2)
    trace = [TraceRequest(0.0, 3000, 1000, "x"), TraceRequest(0.1, 100, 20, "x")]
    sim = Simulation(trace, cfg, PROFILE)
    sim.run()
    for r in sim.reqs:
        kv = admission_kv_tokens(
            r.prompt, r.output, cfg.decode_reserve_tokens, PROFILE.max_context_tokens
        )
        assert r.blocks == -(-kv // cfg.block_size)
    assert sim.reqs[0].blocks == -(-(3000 + 256) // 16)  # horizon 256, not the whole output


def test_static_paper_has_no_door_and_drops_queued_work_60s_after_arrival() -> None:
    """The paper's baseline: static 4P4D round robin, nothing shed at the door, and a request
    still queued 60 s after it arrived aborted (its deadline 2 s + a 58 s margin)."""
    cfg = config_for("static-paper", SimConfig(workers=2))
    assert (cfg.fluidtoken, cfg.fluidrole, cfg.pairing) == (False, False, "round_robin")
    assert not cfg.shedding.sheds and cfg.shedding.decode_backlog_batches == 0.0
    assert cfg.shedding.expire_margin_s == pytest.approx(PAPER_ABORT_AFTER_S - TTFT_S)
    assert cfg.queue_timeout_s == 0.0  # one abort rule, not two
    sim = Simulation(flood(n=160), cfg, PROFILE)
    s = sim.run().summary(TTFT_S, TPOT_S)
    t_pre = PROFILE.prefill_time_s(6000)
    started = 160 - s["expired"]
    assert abs(started - (math.ceil(PAPER_ABORT_AFTER_S / t_pre) + 1)) <= 1
    assert s["rejected"] == 0 and s["failed"] == 0
    # An SLO the 60 s abort cannot sit behind is a configuration error, not a silent clamp.
    strict = dataclasses.replace(SimConfig().policy, ttft_ms=61_000.0)
    with pytest.raises(SimConfigError):
        config_for("static-paper", SimConfig(policy=strict))
