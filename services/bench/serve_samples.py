"""``fluidpd bench serve``'s measurements: the fixed-step profile, and how one streamed
request becomes samples (TTFT, gaps, stage breakdown) on each path.

Pure functions of what a path returned; serve.py runs the paths and summarises.
"""

from __future__ import annotations

import itertools
from typing import Any

from services.bench.bus_client import StreamRecord
from shared.policy.predictors import LatencyProfile

PREFILL_C0_S = 0.005
PREFILL_C1_S_PER_TOKEN = 1e-6
DECODE_A0_S = 0.005
SEED = 1234


def bench_profile() -> LatencyProfile:
    """Known, fixed step times: prefill 5 ms + 1 µs/token, decode 5 ms per iteration."""
    return LatencyProfile(
        model="tiny",
        hardware="bench serve: fixed step times",
        prefill_c1_s_per_token=PREFILL_C1_S_PER_TOKEN,
        prefill_c0_s=PREFILL_C0_S,
        suffix_s1_s_per_token=PREFILL_C1_S_PER_TOKEN,
        suffix_attn_s_per_token_pair=0.0,
        suffix_s0_s=0.001,
        decode_ac_s_per_ctx_token=0.0,
        decode_an_s_per_seq=0.0,
        decode_a0_s=DECODE_A0_S,
        kv_bytes_per_token=16,
        kv_capacity_tokens=1 << 16,
        max_context_tokens=1024,
        derivation="written by fluidpd bench serve: constant step times, not a measurement",
    )


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (ms values in, rounded ms out); None for no samples."""
    if not values:
        return None
    xs = sorted(values)
    return round(xs[min(len(xs) - 1, max(0, int(q * len(xs) + 0.999999) - 1))], 3)


def prompt_of(index: int, length: int) -> list[int]:
    return [4 + (index * 131 + i * 17) % 300 for i in range(length)]


def visible_times(
    tokenizer: Any, prompt: list[int], tokens: list[int], chunks: list[tuple[float, str]]
) -> tuple[list[float | None], list[bool]] | None:
    """Per token: the client time of the chunk that first shows its text, and whether the
    token shows text by itself (not held back as incomplete UTF-8). None when the streamed
    text differs from the reference."""
    from shared.tokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tokenizer, list(prompt))
    pieces = [detok.push(tok) for tok in tokens]
    cum = list(itertools.accumulate(len(piece) for piece in pieces))
    text = "".join(pieces) + detok.flush()
    final = len(text)
    if "".join(chunk for _, chunk in chunks) != text:
        return None
    own = [cum[i] > (cum[i - 1] if i else 0) for i in range(len(tokens))]
    # need[i]: the text length at which token i's bytes are out (its own, or the next
    # token's that completes them; the final flush for trailing incomplete bytes).
    need = [final] * len(tokens)
    nxt = final
    for i in range(len(tokens) - 1, -1, -1):
        if own[i]:
            nxt = cum[i]
        need[i] = nxt
    out: list[float | None] = []
    j, acc = 0, 0
    for i in range(len(tokens)):
        while j < len(chunks) and acc + len(chunks[j][1]) < need[i]:
            acc += len(chunks[j][1])
            j += 1
        out.append(chunks[j][0] if j < len(chunks) and need[i] > 0 else None)
    return out, own


Samples = dict[str, list[float]]


def router_samples(
    out: Samples, tok: Any, prompt: list[int], ref: list[int], got: dict[str, Any]
) -> bool:
    """Add one routed request's figures to ``out``. False when its text was not exact."""
    prefill_ms = (PREFILL_C0_S + PREFILL_C1_S_PER_TOKEN * len(prompt)) * 1e3
    iter_ms = DECODE_A0_S * 1e3
    mapped = visible_times(tok, prompt, ref, got["chunks"])
    if mapped is None:
        return False
    vis, own = mapped
    if own[0] and vis[0] is not None:  # else its bytes wait for the next token
        out["ttft_ms"].append(vis[0] * 1e3)
        out["ttft_overhead_ms"].append(vis[0] * 1e3 - prefill_ms)
    stamps = got["ext"].get("worker_timestamps", {})
    recv = got["ext"].get("token_receive_s", [])
    if "prefill_start_s" in stamps and "prefill_end_s" in stamps and recv:
        # One host, one wall clock: client -> prefill start; prefill end -> router.
        out["before_prefill_ms"].append((stamps["prefill_start_s"] - got["sent_wall"]) * 1e3)
        out["prefill_end_to_router_ms"].append((recv[0] - stamps["prefill_end_s"]) * 1e3)
        ext = got["ext"]
        if ext.get("sent_s") and "queued_s" in stamps:  # the router's own part of it
            out["client_to_router_ms"].append((ext["arrival_s"] - got["sent_wall"]) * 1e3)
            out["router_internal_ms"].append((ext["sent_s"] - ext["arrival_s"]) * 1e3)
            out["router_to_worker_queue_ms"].append((stamps["queued_s"] - ext["sent_s"]) * 1e3)
        span_s = stamps["prefill_end_s"] - stamps["prefill_start_s"]
        out["worker_prefill_overshoot_ms"].append(span_s * 1e3 - prefill_ms)
    if vis[1] is not None and vis[0] is not None and own[0] and own[1]:
        out["first_decode_gap_overhead_ms"].append((vis[1] - vis[0]) * 1e3 - iter_ms)
    for k in range(2, len(ref)):
        a, b = vis[k - 1], vis[k]
        if own[k] and own[k - 1] and a is not None and b is not None:
            out["gap_ms"].append((b - a) * 1e3)
            out["per_token_overhead_ms"].append((b - a) * 1e3 - iter_ms)
    for k in range(2, len(recv)):
        out["router_recv_per_token_overhead_ms"].append((recv[k] - recv[k - 1]) * 1e3 - iter_ms)
    # Router -> client delivery of the tokens that show text at once.
    walls = dict(zip((t for t, _ in got["chunks"]), got["walls"], strict=True))
    for k in range(min(len(recv), len(ref))):
        if own[k] and vis[k] is not None:
            out["router_to_client_ms"].append((walls[vis[k]] - recv[k]) * 1e3)
    return True


def bus_samples(out: Samples, prompt: list[int], ref: list[int], st: StreamRecord) -> bool:
    """Add one bus-path request's figures to ``out``. False when its tokens were not exact."""
    if st.error is not None or st.token_ids != ref:
        return False
    prefill_ms = (PREFILL_C0_S + PREFILL_C1_S_PER_TOKEN * len(prompt)) * 1e3
    iter_ms = DECODE_A0_S * 1e3
    t = [s - st.sent_s for s in st.recv_s]
    out["ttft_ms"].append(t[0] * 1e3)
    out["gap_ms"] += [(t[k] - t[k - 1]) * 1e3 for k in range(2, len(t))]
    out["ttft_overhead_ms"].append(t[0] * 1e3 - prefill_ms)
    if len(t) > 1:
        out["first_decode_gap_overhead_ms"].append((t[1] - t[0]) * 1e3 - iter_ms)
    out["per_token_overhead_ms"] += [(t[k] - t[k - 1]) * 1e3 - iter_ms for k in range(2, len(t))]
    stamps = st.timestamps
    if "prefill_start_s" in stamps and "prefill_end_s" in stamps:
        out["before_prefill_ms"].append((stamps["prefill_start_s"] - st.sent_wall_s) * 1e3)
        out["prefill_end_to_client_ms"].append((st.recv_wall_s[0] - stamps["prefill_end_s"]) * 1e3)
    return True


def direct_samples(out: Samples, ref: list[int], tokens: list[int], times: list[float]) -> bool:
    """Add one direct request's figures to ``out``. False when its tokens were not exact."""
    if tokens != ref:
        return False
    out["ttft_ms"].append(times[0] * 1e3)
    if len(times) > 1:
        out["first_gap_ms"].append((times[1] - times[0]) * 1e3)
    out["gap_ms"] += [(times[k] - times[k - 1]) * 1e3 for k in range(2, len(times))]
    return True
