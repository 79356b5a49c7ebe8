"""FluidToken's suffix allowance and per-iteration chunk stay TPOT-safe on long prefixes
(issue 16 item 4): both are inverted on the prefix context the suffix attends to, and there
is no minimum chunk when there is no slack."""

from __future__ import annotations

import dataclasses

import pytest

from shared.policy.config import PolicyConfig
from shared.policy.predictors import example_profile
from shared.policy.pressure import (
    max_suffix_tokens,
    offered_budget_tokens,
    suffix_allowance_tokens,
    suffix_chunk_tokens,
)

# A profile whose suffix cost grows visibly with the context (attention term 2e-9 s/pair).
PROF = dataclasses.replace(example_profile(), suffix_attn_s_per_token_pair=2e-9)
CFG = PolicyConfig()
SLACK_S = 0.05  # η·Δ = 62.5 ms of one iteration


@pytest.mark.parametrize("context", [0, 2_000, 8_000, 30_000])
def test_allowance_fits_the_slack_on_its_own_prefix(context: int) -> None:
    budget_s = CFG.eta * SLACK_S
    allowed = suffix_allowance_tokens(1e9, SLACK_S, context, PROF, CFG)
    assert allowed > 0
    assert PROF.suffix_time_s(allowed, context) <= budget_s + 1e-12
    assert PROF.suffix_time_s(allowed + 1, context) > budget_s  # and it is the longest one


def test_allowance_shrinks_with_the_prefix_where_context_zero_would_overrun() -> None:
    at_zero = suffix_allowance_tokens(1e9, SLACK_S, 0, PROF, CFG)
    long_prefix = 30_000
    at_long = suffix_allowance_tokens(1e9, SLACK_S, long_prefix, PROF, CFG)
    assert at_long < at_zero
    # The old rule (inverted at context 0) would run at_zero tokens on a 30k prefix and
    # overrun η·Δ: the bug this pins.
    assert PROF.suffix_time_s(at_zero, long_prefix) > CFG.eta * SLACK_S


def test_allowance_is_capped_by_the_offered_budget_and_zero_without_slack() -> None:
    assert suffix_allowance_tokens(100.0, SLACK_S, 1_000, PROF, CFG) == 100
    assert suffix_allowance_tokens(1e9, 0.0, 1_000, PROF, CFG) == 0
    assert suffix_allowance_tokens(1e9, -0.02, 1_000, PROF, CFG) == 0
    assert offered_budget_tokens(500.0, 200) == 300.0
    assert offered_budget_tokens(500.0, 900) == 0.0


def test_advertised_budget_assumes_a_real_prefix_by_default() -> None:
    assert CFG.budget_context_tokens > 0
    assert max_suffix_tokens(SLACK_S, PROF, CFG) < max_suffix_tokens(
        SLACK_S, PROF, dataclasses.replace(CFG, budget_context_tokens=0)
    )
    assert max_suffix_tokens(SLACK_S, PROF, CFG, 0) == max_suffix_tokens(
        SLACK_S, PROF, dataclasses.replace(CFG, budget_context_tokens=0)
    )


def test_no_minimum_chunk_without_slack_while_requests_decode() -> None:
    for slack in (0.0, -0.01, 1e-9):  # 1e-9 s does not even cover s0
        assert (
            suffix_chunk_tokens(slack, 4_000, PROF, CFG, decoding=True, idle_chunk_tokens=512) == 0
        )


def test_chunk_fits_the_slack_on_its_prefix_and_is_free_when_nothing_decodes() -> None:
    for context in (0, 10_000, 30_000):
        chunk = suffix_chunk_tokens(
            SLACK_S, context, PROF, CFG, decoding=True, idle_chunk_tokens=512
        )
        assert chunk > 0
        assert PROF.suffix_time_s(chunk, context) <= CFG.eta * SLACK_S + 1e-12
    # Nobody's TPOT at risk: the configured chunk, even with no slack (suffixes progress).
    assert suffix_chunk_tokens(-1.0, 4_000, PROF, CFG, decoding=False, idle_chunk_tokens=512) == 512


def test_worker_and_simulator_use_the_same_functions() -> None:
    import services.sim.cluster as sim_cluster
    import services.sim.decode_path as sim_decode
    import services.sim.telemetry as sim_telemetry
    import services.worker.decode.decode_intake as intake
    import services.worker.policy as policy

    assert policy.suffix_chunk_tokens is sim_decode.suffix_chunk_tokens
    assert policy.suffix_allowance_tokens is sim_telemetry.suffix_allowance_tokens
    assert policy.offered_budget_tokens is sim_telemetry.offered_budget_tokens
    assert policy.decode_load_from_pool is sim_telemetry.decode_load_from_pool
    # The simulator computes each request's reservation once, where it builds the request.
    assert intake.admission_kv_tokens is sim_cluster.admission_kv_tokens
