"""``fluidpd bench serve``'s figures: percentiles of each path's samples, what the router
adds over the direct path and over the stack floor, and whether the goals (issue 4) are met.

Pure functions of the samples (serve_samples.py makes them; serve.py runs the paths).
"""

from __future__ import annotations

from typing import Any

from services.bench.serve_samples import Samples, pct

GOAL_TTFT_P99_MS = 2.0
GOAL_PER_TOKEN_MS = 0.5


def summarize(name: str, samples: list[float]) -> dict[str, float | None]:
    return {f"{name}_p50": pct(samples, 0.5), f"{name}_p99": pct(samples, 0.99)}


def figures(routed: Samples, bus: Samples, floor_s: Samples, direct: Samples) -> dict[str, Any]:
    """Every percentile the bench reports (ms) and the sample count behind each kind."""
    out: dict[str, Any] = {}
    # Against the engine called directly, at the same percentile (the goals' figures).
    for name, samples in (("", routed), ("bus_only_", bus), ("floor_", floor_s)):
        for key, per in (("ttft", "ttft_ms"), ("per_token", "gap_ms")):
            for q, label in ((0.5, "p50"), (0.99, "p99")):
                path_q, direct_q = pct(samples[per], q), pct(direct[per], q)
                out[f"{name}{key}_added_vs_direct_ms_{label}"] = (
                    None if path_q is None or direct_q is None else round(path_q - direct_q, 3)
                )
    out |= summarize("ttft_added_paired_ms", routed["ttft_added_paired_ms"])
    out |= summarize("router_minus_floor_ttft_ms", routed["router_minus_floor_ttft_ms"])
    for key in ("ttft_ms", "gap_ms", "first_gap_ms"):
        out |= summarize(f"direct_{key}", direct[key])
    out |= summarize("router_ttft_ms", routed["ttft_ms"])
    out |= summarize("router_gap_ms", routed["gap_ms"])
    for key in ("ttft_overhead_ms", "per_token_overhead_ms"):
        out |= summarize(key, routed[key])
        out |= summarize(f"bus_only_{key}", bus[key])
    for key in (
        "first_decode_gap_overhead_ms",
        "before_prefill_ms",
        "client_to_router_ms",
        "router_internal_ms",
        "router_to_worker_queue_ms",
        "prefill_end_to_router_ms",
        "worker_prefill_overshoot_ms",
        "router_to_client_ms",
        "router_recv_per_token_overhead_ms",
    ):
        out |= summarize(key, routed[key])
    for key in ("first_decode_gap_overhead_ms", "before_prefill_ms", "prefill_end_to_client_ms"):
        out |= summarize(f"bus_only_{key}", bus[key])
    out |= summarize("router_minus_bus_ttft_ms", routed["router_minus_bus_ttft_ms"])
    out |= {
        "ttft_samples": len(routed["ttft_ms"]),
        "bus_only_ttft_samples": len(bus["ttft_ms"]),
        "direct_ttft_samples": len(direct["ttft_ms"]),
        "floor_ttft_samples": len(floor_s["ttft_ms"]),
        "per_token_samples": len(routed["per_token_overhead_ms"]),
        "bus_only_per_token_samples": len(bus["per_token_overhead_ms"]),
        "direct_per_token_samples": len(direct["gap_ms"]),
    }
    return out


def goals(figs: dict[str, Any]) -> dict[str, Any]:
    """The goals and whether ``figs`` (from ``figures``) meets them."""
    ttft99, tok99 = figs["ttft_added_vs_direct_ms_p99"], figs["per_token_added_vs_direct_ms_p99"]
    # The older reading (a path minus the profile's prediction) for comparison.
    old_ttft99, old_tok99 = figs["ttft_overhead_ms_p99"], figs["per_token_overhead_ms_p99"]
    return {
        "goal_ttft_p99_ms": GOAL_TTFT_P99_MS,
        "goal_per_token_ms": GOAL_PER_TOKEN_MS,
        "meets_ttft_goal": ttft99 is not None and ttft99 < GOAL_TTFT_P99_MS,
        "meets_per_token_goal": tok99 is not None and tok99 < GOAL_PER_TOKEN_MS,
        "meets_ttft_goal_vs_prediction": old_ttft99 is not None and old_ttft99 < GOAL_TTFT_P99_MS,
        "meets_per_token_goal_vs_prediction": old_tok99 is not None
        and old_tok99 < GOAL_PER_TOKEN_MS,
    }
