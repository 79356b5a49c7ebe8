"""Simulator ↔ worker alignment of decode-side waiting (services/worker/prefill/prefill_role.py,
admission.py): the prefill worker computes a prompt first and asks decode admission beside
it; a request the decode side refuses waits with its prompt KV held on the prefill worker
(part of its block pool) while the next prompts compute, is re-paired with a decode worker
that has room, or fails after ``decode_wait_s``. While it waits it counts in its decode
worker's DPI_adm and FluidRole view as ``decode_waiting``, as the live decode worker's
WaitingAdmissions does, and not once it is admitted."""

from __future__ import annotations

from dataclasses import replace

from services.bench.workloads import TraceRequest
from services.sim import SimConfig, Simulation, config_for
from shared.engine.profiles import load_profile
from shared.policy.admission import SheddingConfig
from shared.policy.pressure import admission_kv_tokens, dpi_adm

PROFILE = load_profile()
NO_SHEDDING = SheddingConfig(ttft_multiple=0.0, expire_margin_s=None, decode_backlog_batches=0.0)


def _static(**kw: object) -> SimConfig:
    base = SimConfig(workers=2, prefill_workers=1, max_num_seqs=1, shedding=NO_SHEDDING)
    return config_for("static", replace(base, **kw))  # type: ignore[arg-type]


def test_a_refused_request_counts_as_waiting_admission_demand() -> None:
    trace = [TraceRequest(0.0, 200, 3000, "x")]
    cfg = config_for("full", SimConfig(workers=4, prefill_workers=3, max_num_seqs=2))
    sim = Simulation(trace, cfg, PROFILE)
    p = sim.workers[0]
    d = next(w for w in sim.workers if w.role == "decode")
    r = sim.reqs[0]
    d.requests = 1  # one of its two slots taken
    r.dw = d.index
    p.adm_waiting[r.idx] = r  # refused for capacity, retried by p (r.blocks == 0)
    sim.count_waiting()
    kv = admission_kv_tokens(200, 3000, cfg.decode_reserve_tokens, PROFILE.max_context_tokens)
    assert (d.waiting_tel, d.waiting_kv_tel) == (1, kv)
    load = sim.decode_load(d)
    # 1 admitted + 1 waiting = both slots: DPI_adm says "full", as the worker's would.
    assert load.admitted_requests == 2 and dpi_adm(load) == 1.0
    del p.adm_waiting[r.idx]  # admitted: no longer waiting
    sim.count_waiting()
    assert (d.waiting_tel, d.waiting_kv_tel) == (0, 0)
    assert sim.decode_load(d).admitted_requests == 1


def test_prefill_computes_on_while_computed_requests_wait_for_decode() -> None:
    # One decode slot, taken by a long decode: the prompts behind it are computed (first
    # token streamed) long before the slot frees, and all complete afterwards.
    trace = [TraceRequest(0.0, 1000, 2000, "a")] + [
        TraceRequest(0.5 + 0.1 * i, 1000, 4, "b") for i in range(3)
    ]
    sim = Simulation(trace, _static(), PROFILE)
    sim.run()
    first, *rest = sim.reqs
    assert not any(r.failed for r in sim.reqs)
    slot_free_s = first.t_last
    assert slot_free_s > 10.0  # the decode really was long (the premise)
    for r in rest:
        assert r.t_first < 2.0 < slot_free_s  # computed at once, not after the slot freed
        assert r.t_last >= slot_free_s  # decoded only once admitted
    assert all(w.local_blocks == 0 and not w.adm_waiting for w in sim.workers)


def test_held_kv_counts_against_the_prefill_pool() -> None:
    # 160 blocks a worker: the prefill worker holds two waiting 1000-token prompts (63
    # blocks each), the third waits for blocks and computes only once one is exported.
    trace = [TraceRequest(0.0, 1000, 2000, "a")] + [
        TraceRequest(0.5 + 0.1 * i, 1000, 4, "b") for i in range(3)
    ]
    sim = Simulation(trace, _static(num_kv_blocks=160), PROFILE)
    sim.run()
    a, b, c, d = sim.reqs
    assert not any(r.failed for r in sim.reqs)
    assert b.t_first < 2.0 and c.t_first < 2.0
    assert d.t_first > a.t_last  # blocked by the KV its predecessors hold
    assert all(w.local_blocks == 0 for w in sim.workers)


def test_a_waiting_request_fails_after_the_decode_wait_timeout() -> None:
    trace = [TraceRequest(0.0, 1000, 2000, "a"), TraceRequest(0.5, 1000, 4, "b")]
    sim = Simulation(trace, _static(decode_wait_s=1.0), PROFILE)
    sim.run()
    a, b = sim.reqs
    assert not a.failed and b.failed
    assert 0.5 < b.t_first < 2.0  # its first token was streamed before it gave up
    assert all(w.local_blocks == 0 and not w.adm_waiting for w in sim.workers)


def test_a_refused_request_is_re_paired_with_a_decode_worker_with_room() -> None:
    # 1P2D round robin: a -> decode 1 (long), b -> decode 2 (done at once), c -> decode 1
    # (full): c moves to decode 2 instead of waiting for a's slot.
    trace = [
        TraceRequest(0.0, 1000, 2000, "a"),
        TraceRequest(0.0, 200, 1, "b"),
        TraceRequest(1.0, 200, 4, "c"),
    ]
    sim = Simulation(trace, _static(workers=3), PROFILE)
    sim.run()
    a, _b, c = sim.reqs
    assert not any(r.failed for r in sim.reqs)
    assert a.dw != c.dw
    assert c.t_last < a.t_last


def test_a_computed_request_waiting_for_decode_does_not_hold_a_p2d_drain() -> None:
    # As switch.py: the switch adds the decode capacity it waits for; it keeps its blocks.
    trace = [TraceRequest(0.0, 1000, 4, "a")]
    sim = Simulation(trace, _static(workers=3, prefill_workers=2), PROFILE)
    p, r = sim.workers[0], sim.reqs[0]
    r.pw, r.dw, r.computed, r.local_blocks = p.index, 2, True, 63
    r.wait_since = 0.0
    p.adm_waiting[r.idx] = r
    p.local_blocks = 63
    sim.start_switch(p, "decode")
    assert p.state == "switch"  # drained at once: nothing queued or computing
    assert p.adm_waiting == {r.idx: r} and p.local_blocks == 63


def test_a_wait_for_a_decode_slot_after_the_first_token_is_counted_as_a_tpot_miss() -> None:
    # The three short requests get their first token within the TTFT SLO, then wait > 10 s
    # for the one decode slot: TPOT (wait included) misses, which the summary counts apart.
    trace = [TraceRequest(0.0, 1000, 2000, "a")] + [
        TraceRequest(0.5 + 0.1 * i, 1000, 4, "b") for i in range(3)
    ]
    waited = Simulation(trace, _static(), PROFILE).run().summary(2.0, 0.1)
    assert waited["ttft_attainment"] == 1.0
    assert waited["tpot_missed_after_ttft"] == 3
    assert waited["joint_attainment"] == 0.25
    assert waited["per_window"]["0"]["tpot_missed_after_ttft"] == 3
    roomy = Simulation(trace, _static(max_num_seqs=4), PROFILE).run().summary(2.0, 0.1)
    assert roomy["tpot_missed_after_ttft"] == 0 and roomy["joint_attainment"] == 1.0
