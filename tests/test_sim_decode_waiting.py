"""Simulator ↔ worker alignment: a request its decode worker refused for capacity, retried
by its prefill worker (a prefill queue head not admitted yet), counts in that decode
worker's DPI_adm and FluidRole view as ``decode_waiting`` — as the live decode worker's
WaitingAdmissions does — and not once it is admitted."""

from __future__ import annotations

from services.bench.workloads import TraceRequest
from services.sim import SimConfig, Simulation, config_for
from shared.engine.profiles import load_profile
from shared.policy.pressure import admission_kv_tokens, dpi_adm

PROFILE = load_profile()


def test_a_refused_request_counts_as_waiting_admission_demand() -> None:
    trace = [TraceRequest(0.0, 200, 3000, "x")]
    cfg = config_for("full", SimConfig(workers=4, prefill_workers=3, max_num_seqs=2))
    sim = Simulation(trace, cfg, PROFILE)
    p = sim.workers[0]
    d = next(w for w in sim.workers if w.role == "decode")
    r = sim.reqs[0]
    d.requests = 1  # one of its two slots taken
    r.dw = d.index
    p.current = r  # the head of p's queue, admission not granted yet (r.blocks == 0)
    sim.count_waiting()
    kv = admission_kv_tokens(200, 3000, cfg.decode_reserve_tokens, PROFILE.max_context_tokens)
    assert (d.waiting_tel, d.waiting_kv_tel) == (1, kv)
    load = sim.decode_load(d)
    # 1 admitted + 1 waiting = both slots: DPI_adm says "full", as the worker's would.
    assert load.admitted_requests == 2 and dpi_adm(load) == 1.0
    r.blocks = -(-kv // cfg.block_size)  # admitted: no longer waiting
    sim.count_waiting()
    assert (d.waiting_tel, d.waiting_kv_tel) == (0, 0)
    assert sim.decode_load(d).admitted_requests == 1
