"""Logprobs in the engine (tiny model): the sampled token's logprob is the log-softmax of
the logits that chose it; prompt logprobs computed in chunks equal those of one pass."""

from __future__ import annotations

import random

import pytest
import torch

from shared.engine.batch import StepInput
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine, SampleSpec
from shared.engine.logprobs import prompt_spec
from shared.sampling_params import SamplingParams

BLOCK = 4


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load(EngineConfig(model="tiny", block_size=BLOCK, num_kv_blocks=256))


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _reference(engine: Engine, ids: list[int]) -> torch.Tensor:
    """log-softmax of the logits at every position of ``ids`` (one pass, row per token)."""
    bm = engine.block_manager
    bm.allocate("ref", len(ids))
    try:
        steps = [StepInput("ref", ids[: i + 1], 0, bm.block_table("ref")) for i in range(len(ids))]
        # Each prefix on its own: the last row of a prefix of length i+1 is position i.
        rows = [engine.forward([s])[0] for s in steps]
    finally:
        bm.free_sequence("ref")
    return torch.log_softmax(torch.stack(rows).float(), dim=-1)


def test_sampled_and_prompt_logprobs_match_log_softmax(engine: Engine) -> None:
    vocab = engine.model_config.vocab_size
    ids = _prompt(11, vocab, 1)
    ref = _reference(engine, ids)
    params = SamplingParams(max_tokens=4, logprobs=5, prompt_logprobs=3)
    bm = engine.block_manager
    free_before = bm.num_free_blocks
    bm.allocate("s", len(ids) + 1)
    table = bm.block_table("s")
    # Two chunks (5 + 6 tokens): the first chunk's last row scores the second chunk's first.
    chunks = [(0, ids[:5]), (5, ids[5:])]
    prompt_lps = []
    out = None
    for start, chunk in chunks:
        done = start + len(chunk) == len(ids)
        out = engine.step_full(
            [StepInput("s", chunk, start, table)],
            [SampleSpec(params, 0, 7) if done else None],
            [prompt_spec(ids, start, len(chunk), params.prompt_logprobs)],
        )
        prompt_lps.extend(out.prompt_logprobs[0])
    bm.free_sequence("s")
    assert bm.num_free_blocks == free_before
    assert out is not None
    assert len(prompt_lps) == len(ids) - 1
    for pos, lp in enumerate(prompt_lps, start=1):
        assert abs(lp.logprob - ref[pos - 1, ids[pos]].item()) < 1e-4
        assert len(lp.top_ids) == 3
        assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
        assert lp.top_ids[0] == int(ref[pos - 1].argmax())
    first, first_lp = out.tokens[0], out.logprobs[0]
    assert first == int(ref[-1].argmax())  # greedy
    assert first_lp is not None
    assert abs(first_lp.logprob - ref[-1].max().item()) < 1e-4
    assert first_lp.top_ids[0] == first and len(first_lp.top_ids) == 5
    assert all(v <= 0 for v in first_lp.top_logprobs)
    assert list(first_lp.top_logprobs) == sorted(first_lp.top_logprobs, reverse=True)


def test_logprobs_do_not_depend_on_temperature(engine: Engine) -> None:
    """Raw logprobs (vLLM's default): a sampled token is scored before temperature."""
    ids = _prompt(6, engine.model_config.vocab_size, 2)
    ref = _reference(engine, ids)
    bm = engine.block_manager
    bm.allocate("t", len(ids))
    try:
        step = StepInput("t", ids, 0, bm.block_table("t"))
        spec = SampleSpec(SamplingParams(temperature=1.7, seed=3, logprobs=0), 0, 3)
        out = engine.step_full([step], [spec])
    finally:
        bm.free_sequence("t")
    tok, lp = out.tokens[0], out.logprobs[0]
    assert tok is not None and lp is not None and lp.top_ids == ()
    assert abs(lp.logprob - ref[-1, tok].item()) < 1e-4


def test_no_logprobs_unless_asked(engine: Engine) -> None:
    ids = _prompt(5, engine.model_config.vocab_size, 3)
    bm = engine.block_manager
    bm.allocate("n", len(ids))
    try:
        step = StepInput("n", ids, 0, bm.block_table("n"))
        out = engine.step_full([step], [SampleSpec(SamplingParams(), 0, 1)])
    finally:
        bm.free_sequence("n")
    assert out.tokens[0] is not None
    assert out.logprobs == [None] and out.prompt_logprobs == [[]]
