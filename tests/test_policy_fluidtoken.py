"""Algorithm 1 (FluidToken stealing-ratio selection) on hand-worked cases and properties."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.policy.config import PolicyConfig
from shared.policy.fluidtoken import StealBudget, select_steal_ratios
from shared.policy.predictors import example_profile
from shared.policy.prefill_pressure import QueuedRequest, ppi_steal_values

CFG = PolicyConfig()  # TTFT 2 s, budgets stale after 100 ms
# 1 ms per prompt token and no fixed cost, on both sides, so deficits are easy by hand.
PROF = dataclasses.replace(
    example_profile(),
    prefill_c1_s_per_token=1e-3,
    prefill_c0_s=0.0,
    suffix_s1_s_per_token=1e-3,
    suffix_attn_s_per_token_pair=0.0,
    suffix_s0_s=0.0,
)


def q(rid: str, tokens: int, decode_id: str, arrival_s: float = 0.0) -> QueuedRequest:
    return QueuedRequest(rid, arrival_s, tokens, decode_id)


def fresh(tokens: float, now_s: float = 0.0) -> StealBudget:
    return StealBudget(tokens, now_s)


def test_fig7_splitting_r2_lets_r3_meet_its_deadline() -> None:
    # R1 (500 tok, paired with d1 which has no budget), R2 (1000, d2), R3 (800, d2); all
    # arrived at 0, now = 0, deadlines 2.0. Prefix sums 0.5, 1.5, 2.3 s:
    # X_1 = (0.5-2)/1e-3 < 0, X_2 = -500 < 0, X_3 = (2.3-2.0)/1e-3 = 300 tokens.
    # j=1: budget(d1) = 0 -> take 0; j=2: take = min(300, 1000, 400) = 300 -> β_2 = 0.3.
    queue = [q("R1", 500, "d1"), q("R2", 1000, "d2"), q("R3", 800, "d2")]
    plan = select_steal_ratios(queue, {"d1": fresh(0), "d2": fresh(400)}, PROF, CFG, 0.0)
    assert plan.stolen_tokens == {1: 300}
    assert plan.beta_list(3) == pytest.approx([0.0, 0.3, 0.0])
    assert plan.usage_tokens == {"d2": 300}
    assert plan.ppi == pytest.approx(1.15)  # eq. 5 before stealing: 2.3 / 2.0
    assert (plan.at_risk, plan.unresolved) == (1, 0)
    # Afterwards (eq. 11): R2's prefix 0.7 s against 2.0 - T_sfx(300) = 1.7 -> 1.2/1.7;
    # R3: 0.5 + 0.7 + 0.8 = 2.0 against 2.0 -> exactly 1.0: it now meets its deadline.
    vals = ppi_steal_values(queue, plan.stolen_tokens, PROF, CFG, 0.0)
    assert vals == pytest.approx([0.25, 1.2 / 1.7, 1.0])


def test_budget_runs_out_midway() -> None:
    # One decode worker d1 with 500 tokens; R1..R4 = 1000, 800, 600, 500 tokens.
    # Prefix sums 1.0, 1.8, 2.4, 2.9 s; deadlines 2.0.
    # i=3: X = 400 -> take min(400, 1000, 500) = 400 from R1; budget 100; removed 0.4 s.
    # i=4: X = (2.9 - 0.4 - 2.0)/1e-3 = 500 -> take min(500, 600, 100) = 100 from R1;
    #      budget 0, 400 tokens of deficit remain -> R4 unresolved.
    queue = [q("R1", 1000, "d1"), q("R2", 800, "d1"), q("R3", 600, "d1"), q("R4", 500, "d1")]
    plan = select_steal_ratios(queue, {"d1": fresh(500)}, PROF, CFG, 0.0)
    assert plan.stolen_tokens == {0: 500}
    assert plan.beta(0) == pytest.approx(0.5)
    assert plan.usage_tokens == {"d1": 500}
    assert (plan.at_risk, plan.unresolved) == (2, 1)


def test_one_decode_runs_dry_and_the_next_request_is_stolen_whole() -> None:
    # R1 (300, d1), R2 (700, d2), R3 (1000, d1), R4 (900, d1); budgets d1 = 200, d2 = 1000.
    # Prefix sums 0.3, 1.0, 2.0, 2.9. X_3 = 0 (<= 0: schedulable). X_4 = 900:
    # j=1: min(900, 300, 200) = 200 (d1 now dry); j=2: min(700, 700, 1000) = 700 -> need 0.
    # R2 is stolen whole (β = 1); R3 is never touched because d1 is dry.
    queue = [q("R1", 300, "d1"), q("R2", 700, "d2"), q("R3", 1000, "d1"), q("R4", 900, "d1")]
    plan = select_steal_ratios(queue, {"d1": fresh(200), "d2": fresh(1000)}, PROF, CFG, 0.0)
    assert plan.stolen_tokens == {0: 200, 1: 700}
    assert plan.beta_list(4) == pytest.approx([2 / 3, 1.0, 0.0, 0.0])
    assert plan.usage_tokens == {"d1": 200, "d2": 700}
    # Eq. 11 after: R4's prefix work 0.1 + 0 + 1.0 + 0.9 = 2.0 against 2.0 -> 1.0.
    assert ppi_steal_values(queue, plan.stolen_tokens, PROF, CFG, 0.0)[3] == pytest.approx(1.0)


def test_stale_missing_and_fractional_budgets() -> None:
    now = 5.0  # the Fig. 7 situation, at t = 5
    queue = [q("R1", 500, "d1", now), q("R2", 1000, "d2", now), q("R3", 800, "d2", now)]
    # Published 200 ms ago with a 100 ms staleness bound: counts as zero.
    stale = select_steal_ratios(queue, {"d2": StealBudget(400, now - 0.2)}, PROF, CFG, now)
    assert stale.stolen_tokens == {} and stale.budget_tokens == {}
    assert (stale.at_risk, stale.unresolved) == (1, 1)
    # Exactly at the bound it is still fresh.
    edge = select_steal_ratios(queue, {"d2": StealBudget(400, now - 0.1)}, PROF, CFG, now)
    assert edge.stolen_tokens == {1: 300}
    # No budget published for d2 at all: nothing to steal.
    assert select_steal_ratios(queue, {"d9": fresh(400, now)}, PROF, CFG, now).stolen_tokens == {}
    # Budgets are whole tokens: 250.9 -> 250, so R3 keeps 50 tokens of deficit.
    part = select_steal_ratios(queue, {"d2": fresh(250.9, now)}, PROF, CFG, now)
    assert part.stolen_tokens == {1: 250} and part.unresolved == 1


def test_max_steal_ratio_and_running_prefill() -> None:
    # With β capped at 0.2, R2 supplies at most 200 tokens; the other 100 are missing.
    queue = [q("R1", 500, "d1"), q("R2", 1000, "d2"), q("R3", 800, "d2")]
    cfg = dataclasses.replace(CFG, max_steal_ratio=0.2)
    plan = select_steal_ratios(queue, {"d2": fresh(400)}, PROF, cfg, 0.0)
    assert plan.stolen_tokens == {1: 200} and plan.unresolved == 1
    # A running prefill with 0.1 s left adds 100 tokens to R3's deficit: 400 taken.
    plan = select_steal_ratios(queue, {"d2": fresh(1000)}, PROF, CFG, 0.0, running_remaining_s=0.1)
    assert plan.stolen_tokens == {1: 400}
    # ceil of a fractional deficit: 0.3005 s over -> 300.5 tokens -> 301.
    queue2 = [q("R1", 500, "d1"), q("R2", 1000, "d2"), q("R3", 800, "d2", arrival_s=-0.0005)]
    plan = select_steal_ratios(queue2, {"d2": fresh(1000)}, PROF, CFG, 0.0)
    assert plan.stolen_tokens == {1: 301}


# ---- literal Algorithm 1 as a reference -------------------------------------------------

# Dyadic numbers keep every float sum exact, so the incremental implementation and this
# literal O(n²) transcription of the pseudocode must agree token for token.
DY = dataclasses.replace(
    PROF,
    prefill_c1_s_per_token=2.0**-10,
    prefill_c0_s=2.0**-6,
    suffix_s1_s_per_token=2.0**-10,
    suffix_s0_s=2.0**-7,
)


def literal_algorithm1(queue, budgets_tokens, now_s, ttft_s, ratio=1.0):
    n = len(queue)
    stolen = [0] * n  # line 3
    budget = dict(budgets_tokens)  # line 4
    for i in range(n):  # line 5
        work = sum(DY.prefix_time_s(queue[k].prompt_tokens - stolen[k]) for k in range(i + 1))
        pfx_ddl = (
            queue[i].arrival_s
            + ttft_s
            - DY.suffix_time_s(stolen[i], queue[i].prompt_tokens - stolen[i])
        )
        x = (work - (pfx_ddl - now_s)) / DY.prefill_c1_s_per_token  # line 6, eq. 19
        if x <= 0:  # lines 7-9
            continue
        need = math.ceil(x)  # line 10 (whole tokens)
        for j in range(i):  # line 11
            if need <= 0:  # lines 12-14
                break
            d = queue[j].decode_id  # line 15
            cap = queue[j].prompt_tokens if ratio >= 1 else int(ratio * queue[j].prompt_tokens)
            take = min(need, cap - stolen[j], budget.get(d, 0))  # line 16
            take = max(take, 0)
            stolen[j] += take  # line 17
            if d in budget:
                budget[d] -= take  # line 18
            need -= take  # line 19
    return {j: s for j, s in enumerate(stolen) if s}  # line 22 (as tokens)


requests = st.lists(
    st.tuples(st.integers(1, 3000), st.integers(-32, 32), st.sampled_from(["a", "b", "c"])),
    min_size=0,
    max_size=40,
)
budget_st = st.dictionaries(
    st.sampled_from(["a", "b", "c", "z"]),
    st.tuples(st.floats(0, 5000, allow_nan=False), st.booleans()),
)


@settings(max_examples=150, deadline=None)
@given(requests, budget_st, st.sampled_from([1.0, 0.5]))
def test_properties_and_agreement_with_literal_algorithm(reqs, budgets, ratio) -> None:
    now = 4.0
    queue = [QueuedRequest(f"r{i}", now + a / 16.0 - 1.0, n, d) for i, (n, a, d) in enumerate(reqs)]
    published = {d: StealBudget(tok, now if ok else now - 1.0) for d, (tok, ok) in budgets.items()}
    cfg = dataclasses.replace(CFG, max_steal_ratio=ratio)
    plan = select_steal_ratios(queue, published, DY, cfg, now)
    usable = {d: int(tok) for d, (tok, ok) in budgets.items() if ok and tok >= 1}
    used: dict[str, int] = {}
    for j, s in plan.stolen_tokens.items():
        assert isinstance(s, int) and 0 < s <= queue[j].prompt_tokens
        beta = plan.beta(j)
        assert 0.0 <= beta <= ratio
        assert beta == pytest.approx(s / queue[j].prompt_tokens)
        used[queue[j].decode_id] = used.get(queue[j].decode_id, 0) + s
    for d, total in used.items():
        assert total <= usable.get(d, 0)  # Σ β_i·L_i <= B_d (0 for stale/unknown)
        assert plan.usage_tokens[d] == total
    assert all(0.0 <= b <= 1.0 for b in plan.beta_list(len(queue)))
    assert plan.stolen_tokens == literal_algorithm1(queue, usable, now, cfg.ttft_s, ratio)
