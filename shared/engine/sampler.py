"""Token sampling: greedy, temperature, top-k, top-p, with a per-request deterministic seed."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.sampling_params import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, step) pairs apart
_MASK64 = (1 << 63) - 1


def step_seed(seed: int, step: int) -> int:
    """Generator seed for token number ``step`` of a request seeded with ``seed``."""
    return (seed * _SEED_MIX + step * 0xBF58476D1CE4E5B9 + 1) & _MASK64


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    steps: Sequence[int],
    seeds: Sequence[int],
) -> list[int]:
    """Pick one token per row of ``logits`` ``[B, V]``. Pure: same inputs, same tokens.

    ``steps[i]`` is how many tokens row i's request has generated so far; ``seeds[i]`` its
    resolved seed (the caller resolves ``params.seed is None`` once per request).
    """
    out: list[int] = []
    greedy = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            out.append(int(greedy[i]))
            continue
        row = logits[i].float() / float(p.temperature)
        if p.top_k > 0 and p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            cumulative = sorted_probs.cumsum(0)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            drop = cumulative - sorted_probs >= p.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        gen = torch.Generator(device="cpu").manual_seed(step_seed(seeds[i], steps[i]))
        out.append(int(torch.multinomial(probs.cpu(), 1, generator=gen).item()))
    return out
