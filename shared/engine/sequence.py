"""A request's token state inside an engine, and the stop rules every path shares."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from shared.sampling_params import SamplingParams


@dataclass
class Sequence:
    """Mutable token state of one request on one worker.

    ``num_cached_tokens``: tokens whose KV is in the cache. The next forward computes the
    tokens after it. ``seed`` is the resolved sampling seed (fixed for the request's life).
    """

    seq_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int = -1
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        if self.seed < 0:
            self.seed = self.params.seed if self.params.seed is not None else secrets.randbits(62)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def pending_token_ids(self) -> list[int]:
        """Tokens not yet in the KV cache, in order."""
        return self.all_token_ids[self.num_cached_tokens :]


def finish_reason_after(
    seq: Sequence, token_id: int, eos_token_ids: tuple[int, ...], max_model_len: int
) -> str | None:
    """Why ``seq`` stops after appending ``token_id`` (already appended), or None.

    ``"stop"`` for a stop token id or EOS (unless ``ignore_eos``); ``"length"`` at
    ``max_tokens`` or at the context limit.
    """
    p = seq.params
    if token_id in p.stop_token_ids:
        return "stop"
    if not p.ignore_eos and token_id in eos_token_ids:
        return "stop"
    if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None
