"""PPI (eq. 3–5), DPI (eq. 6–8), slack/budget (eq. 14–17), eq. 9, 11, 19 on hand-worked numbers."""

from __future__ import annotations

import dataclasses

import pytest

from shared.policy.config import PolicyConfig
from shared.policy.errors import PolicyConfigError
from shared.policy.predictors import example_profile
from shared.policy.prefill_pressure import (
    QueuedRequest,
    ppi_steal_values,
    prefix_deadline_s,
    queue_ppi,
    request_ppis,
    token_deficit,
)
from shared.policy.pressure import (
    DecodeLoad,
    admission_kv_tokens,
    decode_pressure,
    dpi_adm,
    dpi_load,
    kv_alloc_tokens,
    max_suffix_tokens,
    n_tpot,
    steal_budget_tokens,
    tpot_slack_s,
)

CFG = PolicyConfig()  # TTFT 2 s, TPOT 0.1 s, ε = 1 ms, η = 1.25, DPI_load^high = 0.6
# Prefill: 1 ms/token + 10 ms; suffix linear: 0.1 ms/token + 5 ms; decode as example_profile
# (a_C = 1e-7, a_N = 2e-4, a_0 = 0.012).
PROF = dataclasses.replace(
    example_profile(),
    prefill_c1_s_per_token=1e-3,
    prefill_c0_s=0.010,
    suffix_s1_s_per_token=1e-4,
    suffix_attn_s_per_token_pair=0.0,
    suffix_s0_s=0.005,
)


def q(rid: str, arrival_s: float, tokens: int, decode_id: str = "d0") -> QueuedRequest:
    return QueuedRequest(rid, arrival_s, tokens, decode_id)


def test_ppi_of_a_queue_by_hand() -> None:
    now = 10.0
    queue = [q("r1", 9.0, 300), q("r2", 9.5, 800), q("r4", 9.9, 1000)]
    # T_pre: 0.31, 0.81, 1.01 -> prefix sums 0.31, 1.12, 2.13.
    # Remaining budgets t_ddl - now: 9+2-10 = 1.0, 1.5, 1.9.
    # PPI_i: 0.31/1.0 = 0.31; 1.12/1.5 = 0.746667; 2.13/1.9 = 1.121053.
    assert request_ppis(queue, PROF, CFG, now) == pytest.approx([0.31, 1.12 / 1.5, 2.13 / 1.9])
    assert queue_ppi(queue, PROF, CFG, now) == pytest.approx(2.13 / 1.9)  # eq. 5: the max
    # A prefill already running with 0.19 s left delays everybody:
    # (0.19 + 2.13) / 1.9 = 1.221053.
    assert queue_ppi(queue, PROF, CFG, now, running_remaining_s=0.19) == pytest.approx(2.32 / 1.9)
    assert queue_ppi([], PROF, CFG, now) == 0.0


def test_ppi_epsilon_for_an_expired_deadline() -> None:
    # r3 arrived at 7.5: deadline 9.5 already passed at now = 10 -> denominator ε = 0.001.
    # Prefix sum 0.31 + 0.11 = 0.42 -> PPI = 0.42 / 0.001 = 420.
    queue = [q("r1", 9.0, 300), q("r3", 7.5, 100)]
    assert request_ppis(queue, PROF, CFG, 10.0)[1] == pytest.approx(420.0)
    # Exactly at the deadline the denominator is ε too (0 is not > ε).
    assert request_ppis([q("r", 8.0, 100)], PROF, CFG, 10.0) == pytest.approx([0.11 / 0.001])


def test_dpi_components_by_hand() -> None:
    load = DecodeLoad(
        kv_capacity_tokens=100_000,
        kv_active_tokens=30_000,
        kv_reserved_tokens=20_000,
        active_requests=40,
    )
    # Eq. 6: 100000 - 30000 - 20000 = 50000.
    assert kv_alloc_tokens(load) == 50_000
    # N_TPOT at c̄ = 30000/40 = 750: per seq 1e-7*750 + 2e-4 = 2.75e-4 s;
    # (0.1 - 0.012) / 2.75e-4 = 320.
    assert n_tpot(load, PROF, CFG) == 320
    # Eq. 7: max(30000/100000, 40/320) = max(0.3, 0.125) = 0.3.
    assert dpi_load(load, 320) == pytest.approx(0.3)
    # Eq. 8: 1 - 50000/100000 = 0.5.
    assert dpi_adm(load) == pytest.approx(0.5)
    # Batch term dominating: 200 requests at c̄ = 150 -> per seq 2.15e-4, N_TPOT = 409;
    # 200/409 = 0.488998 > 30000/100000.
    busy = dataclasses.replace(load, active_requests=200)
    assert n_tpot(busy, PROF, CFG) == 409
    assert dpi_load(busy, 409) == pytest.approx(200 / 409)
    # N_TPOT = 0 is treated as 1: the ratio stays finite and >= N.
    assert dpi_load(busy, 0) == pytest.approx(200.0)
    with pytest.raises(PolicyConfigError):
        DecodeLoad(0, 0, 0, 0)


def test_budget_from_slack_by_hand() -> None:
    load = DecodeLoad(100_000, 30_000, 20_000, 40)
    # Eq. 13/14: T_iter(40, 30000) = 0.003 + 0.008 + 0.012 = 0.023; Δ = 0.1 - 0.023 = 0.077.
    assert tpot_slack_s(load, PROF, CFG) == pytest.approx(0.077)
    # Eq. 16: η·Δ = 1.25*0.077 = 0.09625 s; (0.09625 - 0.005) / 1e-4 = 912.5 tokens.
    assert max_suffix_tokens(0.077, PROF, CFG) == pytest.approx(912.5)
    # Eq. 17 with |P| = 2 paired prefill workers: 912.5 / 2 = 456.25.
    assert steal_budget_tokens(0.3, 912.5, 2, CFG) == pytest.approx(456.25)
    dp = decode_pressure(load, PROF, CFG, n_paired_prefill=2)
    assert (dp.dpi_load, dp.dpi_adm, dp.kv_alloc_tokens, dp.n_tpot) == pytest.approx(
        (0.3, 0.5, 50_000, 320)
    )
    assert dp.steal_budget_tokens == pytest.approx(456.25)
    # Eq. 12/17: DPI_load >= 0.6 -> no stealing at all.
    assert steal_budget_tokens(0.6, 912.5, 2, CFG) == 0.0
    # No slack (over the TPOT SLO) -> no suffix fits.
    assert max_suffix_tokens(-0.01, PROF, CFG) == 0.0
    # η = 1 is the strict per-iteration bound: (0.077 - 0.005)/1e-4 = 720 tokens.
    strict = dataclasses.replace(CFG, eta=1.0)
    assert max_suffix_tokens(0.077, PROF, strict) == pytest.approx(720.0)


def test_budget_with_a_context_dependent_suffix() -> None:
    # s_attn = 2e-9 and an assumed context of 1000 tokens: solve
    # 1e-9·L² + (1e-4 + 2e-9·1000)·L = 0.09625 - 0.005 = 0.09125
    # -> L = (-1.02e-4 + sqrt(1.02e-4² + 4e-9·0.09125)) / 2e-9
    #      = (-1.02e-4 + sqrt(1.0404e-8 + 3.65e-10)) / 2e-9
    #      = (-1.02e-4 + 1.037738e-4) / 2e-9 = 886.9 tokens.
    prof = dataclasses.replace(PROF, suffix_attn_s_per_token_pair=2e-9)
    cfg = dataclasses.replace(CFG, budget_context_tokens=1000)
    assert max_suffix_tokens(0.077, prof, cfg) == pytest.approx(886.9, abs=0.2)


def test_prefix_deadline_and_token_deficit() -> None:
    # Eq. 9: 300 suffix tokens -> T_sfx = 0.005 + 0.03 = 0.035; 12.0 - 0.035 = 11.965.
    assert prefix_deadline_s(12.0, 300, 1000, PROF) == pytest.approx(11.965)
    assert prefix_deadline_s(12.0, 0, 1000, PROF) == 12.0
    # Eq. 19: (2.3 - (12.0 - 10.0)) / 1e-3 = 300 tokens.
    assert token_deficit(2.3, 12.0, 10.0, PROF) == pytest.approx(300.0)
    assert token_deficit(1.5, 12.0, 10.0, PROF) == pytest.approx(-500.0)


def test_ppi_steal_of_a_split_plan_by_hand() -> None:
    # R1 500, R2 1000, R3 800 tokens, all arrived at 0, now = 0, deadline 2.0.
    # Unsplit: prefix sums 0.51, 1.52, 2.33 -> PPI_3 = 2.33/2 = 1.165 > 1.
    queue = [q("r1", 0.0, 500), q("r2", 0.0, 1000), q("r3", 0.0, 800)]
    assert request_ppis(queue, PROF, CFG, 0.0)[2] == pytest.approx(1.165)
    # Steal 400 tokens of R2: its prefix 600 -> 0.61; sums 0.51, 1.12, 1.93.
    # R2's prefix deadline 2.0 - (0.005 + 0.04) = 1.955. Eq. 11:
    # 0.51/2 = 0.255, 1.12/1.955 = 0.572890, 1.93/2 = 0.965 (all <= 1: schedulable).
    vals = ppi_steal_values(queue, {1: 400}, PROF, CFG, 0.0)
    assert vals == pytest.approx([0.255, 1.12 / 1.955, 0.965])


def test_dpi_adm_counts_admission_slots_when_capped() -> None:
    from shared.policy.pressure import DecodeLoad, dpi_adm

    # KV: 1000 tokens, 100 active + 100 reserved -> 0.2 of the pool held.
    assert dpi_adm(DecodeLoad(1000, 100, 100, 10)) == pytest.approx(0.2)
    # Slots below the cap: the paper's KV fraction (eq. 8), however many are used.
    assert dpi_adm(DecodeLoad(1000, 100, 100, 10, admitted_requests=48, max_requests=64)) == (
        pytest.approx(0.2)
    )
    # Every slot taken: nothing can be admitted, so no allocable capacity is left.
    assert dpi_adm(DecodeLoad(1000, 100, 100, 10, admitted_requests=64, max_requests=64)) == (
        pytest.approx(1.0)
    )


def test_admission_reserves_prompt_plus_horizon_within_context() -> None:
    assert admission_kv_tokens(100, 50, 256, 4096) == 150  # short output: all of it
    assert admission_kv_tokens(100, 1000, 256, 4096) == 356  # long output: the horizon
    assert admission_kv_tokens(100, 1000, 0, 4096) == 100  # horizon 0: the prompt only
    assert admission_kv_tokens(4000, 1000, 256, 4096) == 4096  # never past the context
