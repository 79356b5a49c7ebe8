"""Azure trace workloads: determinism, rate scaling, stage order, interleaving, knobs."""

from __future__ import annotations

import itertools

import pytest

from services.bench.workloads import (
    CODE,
    CONVERSATION,
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
    a = build_workload("azure-staged", rps=20, window_s=120)
    b = build_workload("azure-staged", rps=20, window_s=120)
    assert a == b and len(a) > 100


@pytest.mark.parametrize("name", ["azure-staged", "azure-mixed"])
@pytest.mark.parametrize("rps", [5.0, 40.0])
def test_rps_scaling_hits_target_mean_rate(name: str, rps: float) -> None:
    wl = build_workload(name, rps=rps, window_s=300)
    assert abs(mean_rate_rps(wl) - rps) / rps < 0.05
    arrivals = [r.arrival_s for r in wl]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0


def test_staged_has_three_windows_in_source_order() -> None:
    wl = build_workload("azure-staged", rps=10, window_s=200)
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
    wl = build_workload("azure-staged", rps=10, requests=90, window_s=600)
    assert [sum(1 for r in wl if r.window == w) for w in (0, 1, 2)] == [30, 30, 30]


def test_mixed_interleaves_both_sources() -> None:
    wl = build_workload("azure-mixed", rps=20, trace_offset_s=600, window_s=300)
    sources = [r.source for r in wl]
    assert set(sources) == {CODE, CONVERSATION}
    switches = sum(1 for a, b in itertools.pairwise(sources) if a != b)
    assert switches > 50  # interleaved by arrival, not concatenated
    assert {r.window for r in wl} == {0}
    assert len(build_workload("azure-mixed", requests=100, window_s=300)) == 100


def test_time_scale_compresses_time() -> None:
    base = build_workload("azure-mixed", window_s=120)
    fast = build_workload("azure-mixed", window_s=120, time_scale=0.25)
    assert [r.arrival_s * 0.25 for r in base] == pytest.approx([r.arrival_s for r in fast])
    assert mean_rate_rps(fast) == pytest.approx(4 * mean_rate_rps(base))


def test_max_prompt_tokens_clips() -> None:
    base = build_workload("azure-staged", rps=10, window_s=120)
    clipped = build_workload("azure-staged", rps=10, window_s=120, max_prompt_tokens=1000)
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
        {"name": "azure-staged", "window_s": 2000},  # second conversation window past the end
        {"name": "azure-mixed", "time_scale": 0},
    ],
)
def test_bad_arguments_raise(kwargs: dict) -> None:
    name = kwargs.pop("name")
    with pytest.raises(WorkloadError):
        build_workload(name, **kwargs)
