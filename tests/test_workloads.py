"""Azure trace workloads: determinism, rate scaling, stage order, interleaving, knobs."""

from __future__ import annotations

import itertools

import pytest

from services.bench.workloads import (
    CODE,
    CONVERSATION,
    MIXED_REQUESTS,
    STAGE_REQUESTS,
    WorkloadError,
    build_workload,
    load_trace,
    mean_rate_rps,
    window_of,
)


def test_traces_load_from_package_data() -> None:
    code, conv = load_trace(CODE), load_trace(CONVERSATION)
    assert len(code) > 8000 and len(conv) > 19000
    assert all(r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in code + conv)
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(code))
    # The code trace is prefill-heavy, conversation decode-heavy (README: 73:1 vs 5.5:1).
    ratio = lambda t: sum(r.prompt_tokens for r in t) / sum(r.output_tokens for r in t)  # noqa: E731
    assert ratio(code) > 40 > 10 > ratio(conv)


def test_deterministic() -> None:
    a = build_workload("azure-staged", rps=20, requests=600)
    b = build_workload("azure-staged", rps=20, requests=600)
    assert a == b and len(a) == 600
    c = build_workload("azure-staged", rps=20, requests=600, seed=1)
    assert [r.arrival_s for r in c] != [r.arrival_s for r in a]
    assert [(r.prompt_tokens, r.source) for r in c] == [(r.prompt_tokens, r.source) for r in a]


def test_staged_follows_the_paper_three_request_count_stages() -> None:
    # §V-A: three 10K-request stages, conversation → code → conversation, as far as the
    # shipped traces allow (8,819 code requests; 19,366 conversation = 10,000 + 9,366).
    code, conv = load_trace(CODE), load_trace(CONVERSATION)
    wl = build_workload("azure-staged", rps=20)
    sizes = [sum(1 for r in wl if r.window == w) for w in (0, 1, 2)]
    assert sizes == [STAGE_REQUESTS, min(STAGE_REQUESTS, len(code)), len(conv) - STAGE_REQUESTS]
    # Stages are consecutive trace requests, in trace order, conversation never repeated.
    lengths = [(r.prompt_tokens, r.output_tokens) for r in wl]
    conv_lengths = [(r.prompt_tokens, r.output_tokens) for r in conv]
    code_lengths = [(r.prompt_tokens, r.output_tokens) for r in code]
    assert lengths[: sizes[0]] == conv_lengths[: sizes[0]]
    assert lengths[sizes[0] : sizes[0] + sizes[1]] == code_lengths[: sizes[1]]
    assert lengths[sizes[0] + sizes[1] :] == conv_lengths[sizes[0] : sizes[0] + sizes[2]]


def test_staged_arrivals_are_one_poisson_process_at_rps() -> None:
    # §III-A: a constant-rate Poisson arrival process, the same rate in every stage.
    rps = 20.0
    wl = build_workload("azure-staged", rps=rps)
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(wl)]
    assert all(g >= 0 for g in gaps) and wl[0].arrival_s == 0.0
    assert abs(mean_rate_rps(wl) - rps) / rps < 0.02
    # Exponential gaps: coefficient of variation ≈ 1 (a scaled trace is burstier).
    mean = sum(gaps) / len(gaps)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert 0.95 < cv < 1.05
    for w in (0, 1, 2):  # the rate holds within each stage too
        assert abs(mean_rate_rps([r for r in wl if r.window == w]) - rps) / rps < 0.05
    with pytest.raises(WorkloadError):
        build_workload("azure-staged", arrival="poisson")  # Poisson needs a rate
    native = build_workload("azure-staged", requests=300)  # no rate: the traces' own timing
    assert 0.5 < mean_rate_rps([r for r in native if r.window == 1]) < 10


def test_staged_trace_arrivals_scale_each_stage_to_rps() -> None:
    wl = build_workload("azure-staged", rps=10, requests=900, arrival="trace")
    for w in (0, 1, 2):
        stage = [r for r in wl if r.window == w]
        assert len(stage) == 300 and abs(mean_rate_rps(stage) - 10) / 10 < 0.05


@pytest.mark.parametrize("name", ["azure-staged", "azure-mixed"])
@pytest.mark.parametrize("rps", [5.0, 40.0])
def test_rps_hits_target_mean_rate(name: str, rps: float) -> None:
    wl = build_workload(name, rps=rps, requests=3000)
    assert abs(mean_rate_rps(wl) - rps) / rps < 0.05
    arrivals = [r.arrival_s for r in wl]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0


def test_staged_has_three_windows_in_source_order() -> None:
    wl = build_workload("azure-staged", rps=10, requests=900)
    windows = [r.window for r in wl]
    assert windows == sorted(windows) and set(windows) == {0, 1, 2}
    sources = {w: {r.source for r in wl if r.window == w} for w in (0, 1, 2)}
    assert sources == {0: {CONVERSATION}, 1: {CODE}, 2: {CONVERSATION}}
    assert {window_of(r) for r in wl} == {"0:conversation", "1:code", "2:conversation"}
    # The two conversation windows are different segments of the trace.
    w0 = [(r.prompt_tokens, r.output_tokens) for r in wl if r.window == 0]
    w2 = [(r.prompt_tokens, r.output_tokens) for r in wl if r.window == 2]
    assert w0 != w2[: len(w0)]


def test_staged_requests_truncates_per_window() -> None:
    wl = build_workload("azure-staged", rps=10, requests=90)
    assert [sum(1 for r in wl if r.window == w) for w in (0, 1, 2)] == [30, 30, 30]


def test_trace_offset_starts_stages_later_in_the_traces() -> None:
    conv = load_trace(CONVERSATION)
    wl = build_workload("azure-staged", rps=10, requests=30, trace_offset_s=600)
    first = next(r for r in conv if r.arrival_s >= conv[0].arrival_s + 600)
    assert (wl[0].prompt_tokens, wl[0].output_tokens) == (first.prompt_tokens, first.output_tokens)


def test_mixed_interleaves_both_sources() -> None:
    wl = build_workload("azure-mixed", rps=20)
    assert len(wl) == MIXED_REQUESTS  # §V-A: 10K interleaved requests
    sources = [r.source for r in wl]
    assert set(sources) == {CODE, CONVERSATION}
    switches = sum(1 for a, b in itertools.pairwise(sources) if a != b)
    assert switches > 500  # interleaved by arrival, not concatenated
    assert {r.window for r in wl} == {0}
    assert len(build_workload("azure-mixed", requests=100, trace_offset_s=600)) == 100


def test_time_scale_compresses_time() -> None:
    base = build_workload("azure-mixed", requests=500)
    fast = build_workload("azure-mixed", requests=500, time_scale=0.25)
    assert [r.arrival_s * 0.25 for r in base] == pytest.approx([r.arrival_s for r in fast])
    assert mean_rate_rps(fast) == pytest.approx(4 * mean_rate_rps(base))


def test_max_prompt_tokens_clips() -> None:
    base = build_workload("azure-staged", rps=10, requests=900)
    clipped = build_workload("azure-staged", rps=10, requests=900, max_prompt_tokens=1000)
    assert max(r.prompt_tokens for r in base) > 1000
    assert max(r.prompt_tokens for r in clipped) == 1000
    assert [min(r.prompt_tokens, 1000) for r in base] == [r.prompt_tokens for r in clipped]
    assert [r.output_tokens for r in base] == [r.output_tokens for r in clipped]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"name": "nope"},
        {"name": "azure-mixed", "rps": 0},
        {"name": "azure-mixed", "trace_offset_s": 10_000},
        {"name": "azure-staged", "rps": 10, "trace_offset_s": 10_000},  # empty stages
        {"name": "azure-staged", "rps": 10, "arrival": "uniform"},
        {"name": "azure-mixed", "time_scale": 0},
    ],
)
def test_bad_arguments_raise(kwargs: dict) -> None:
    name = kwargs.pop("name")
    with pytest.raises(WorkloadError):
        build_workload(name, **kwargs)
