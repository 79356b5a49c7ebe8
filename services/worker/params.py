"""Wire sampling parameters -> engine sampling parameters (stop strings stay in the router)."""

from __future__ import annotations

from shared import messages
from shared.sampling_params import SamplingParams


def engine_params(wire: messages.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=wire.max_tokens,
        temperature=wire.temperature,
        top_p=wire.top_p,
        top_k=wire.top_k,
        seed=wire.seed,
        stop_token_ids=tuple(wire.stop_token_ids),
        ignore_eos=wire.ignore_eos,
        logprobs=wire.logprobs,
        prompt_logprobs=wire.prompt_logprobs,
    )
