"""Log-probabilities of tokens under the model's raw distribution (OpenAI ``logprobs``).

Choice (as vLLM's default ``logprobs_mode="raw_logprobs"``): a logprob is the log-softmax
of the model's logits *before* temperature, top-k and top-p, so it does not depend on the
sampling settings and a greedy token's logprob equals the engine's log-softmax. Computed
on the worker that has the logits: the one that samples the token, or that computes the
prompt position (prompt logprobs, ``echo``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's bound for top_logprobs; vLLM's default max_logprobs


@dataclass(frozen=True)
class Logprob:
    """One scored token: its logprob and the ``len(top_ids)`` most likely tokens at that
    position (ids and logprobs, most likely first)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class PromptLogprobsSpec:
    """Score prompt tokens at the rows of one step: row ``j`` of the step's new tokens
    (position ``start_pos + j``) scores ``targets[j]``, the prompt token after it. At most
    one target per new token; the sampling row of a prompt's last chunk has none."""

    targets: tuple[int, ...]
    num_top: int


def score_rows(logits: torch.Tensor, targets: Sequence[int], num_top: int) -> list[Logprob]:
    """Logprobs of ``targets[i]`` under row i of ``logits`` ``[N, V]`` plus each row's top
    ``num_top``. Pure; ``len(targets) == N``."""
    if not len(targets):
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    idx = torch.tensor(list(targets), dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, idx[:, None])[:, 0].tolist()
    if num_top > 0:
        top = torch.topk(lp, min(num_top, lp.shape[-1]), dim=-1)
        top_vals, top_ids = top.values.tolist(), top.indices.tolist()
    else:
        top_vals = top_ids = [[] for _ in chosen]
    return [
        Logprob(float(c), tuple(int(t) for t in ti), tuple(float(v) for v in tv))
        for c, ti, tv in zip(chosen, top_ids, top_vals, strict=True)
    ]


@dataclass
class StepOutput:
    """What one engine step produced, per step input: the sampled token (None: no
    sample), its logprob (None unless its spec asked) and prompt logprobs (empty unless
    asked)."""

    tokens: list[int | None]
    logprobs: list[Logprob | None]
    prompt_logprobs: list[list[Logprob]]

    @classmethod
    def empty(cls, n: int) -> StepOutput:
        return cls([None] * n, [None] * n, [[] for _ in range(n)])


def prompt_spec(
    prompt_token_ids: Sequence[int], start_pos: int, num_new_tokens: int, num_top: int | None
) -> PromptLogprobsSpec | None:
    """The prompt rows a step of ``num_new_tokens`` at ``start_pos`` scores (None when not
    asked or when the step holds no prompt row with a next prompt token). Pure."""
    if num_top is None:
        return None
    end = min(start_pos + num_new_tokens + 1, len(prompt_token_ids))
    if start_pos + 1 >= end:
        return None
    return PromptLogprobsSpec(tuple(prompt_token_ids[start_pos + 1 : end]), num_top)
