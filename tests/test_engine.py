"""Engine forward modes on the real `tiny` model (loaded through the real loader)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.engine.batch import StepInput
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.generate import generate
from shared.errors import ContextLengthError, NoFreeBlocksError
from shared.sampling_params import SamplingParams

BLOCK = 4


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load(EngineConfig(model="tiny", block_size=BLOCK, num_kv_blocks=256))


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _logits_unsplit(engine: Engine, ids: list[int], table: list[int]) -> torch.Tensor:
    return engine.forward([StepInput("u", ids, 0, table)])[0]


def _kv(engine: Engine, table: list[int], n: int) -> torch.Tensor:
    """The KV of the first n tokens of a sequence, laid out contiguously by logical position."""
    blocks = engine.arena.tensor[torch.tensor(table)]  # [nb, L, 2, bs, H, D]
    nb, layers, two, bs, h, d = blocks.shape
    return blocks.permute(1, 2, 0, 3, 4, 5).reshape(layers, two, nb * bs, h, d)[:, :, :n]


@settings(max_examples=15, deadline=None)
@given(length=st.integers(2, 60), data=st.data())
def test_chunked_prefill_equals_unsplit(engine: Engine, length: int, data: st.DataObject) -> None:
    rng = random.Random(length)
    ids = _prompt(rng, length, engine.model_config.vocab_size)
    split = data.draw(st.integers(1, length - 1))
    nb = -(-length // BLOCK)
    table_a = list(range(nb))
    table_b = list(range(100, 100 + nb))
    ref = _logits_unsplit(engine, ids, table_a)
    engine.forward([StepInput("s", ids[:split], 0, table_b)])
    got = engine.forward([StepInput("s", ids[split:], split, table_b)])[0]
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(
        _kv(engine, table_b, length), _kv(engine, table_a, length), rtol=0, atol=1e-5
    )


def test_shuffled_block_table_equals_contiguous(engine: Engine) -> None:
    rng = random.Random(7)
    ids = _prompt(rng, 37, engine.model_config.vocab_size)
    nb = -(-(len(ids) + 8) // BLOCK)
    contiguous = list(range(nb))
    shuffled = rng.sample(range(120, 250), nb)

    def run(table: list[int]) -> list[torch.Tensor]:
        outs = [engine.forward([StepInput("x", ids, 0, table)])[0]]
        tok = int(outs[-1].argmax())
        for pos in range(len(ids), len(ids) + 8):
            outs.append(engine.forward([StepInput("x", [tok], pos, table)])[0])
            tok = int(outs[-1].argmax())
        return outs

    for a, b in zip(run(contiguous), run(shuffled), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_mixed_length_batch_equals_each_alone(engine: Engine) -> None:
    rng = random.Random(3)
    vocab = engine.model_config.vocab_size
    prompts = [_prompt(rng, n, vocab) for n in (5, 17, 33, 2)]
    alone = [
        _logits_unsplit(engine, p, list(range(i * 20, i * 20 + -(-len(p) // BLOCK))))
        for i, p in enumerate(prompts)
    ]
    # Prefill the sequences in one mixed batch (different lengths), then decode them together
    # with different context lengths, and compare each decode step with a lone run.
    tables = [list(range(200 - (i + 1) * 12, 200 - i * 12)) for i in range(len(prompts))]
    steps = [StepInput(f"m{i}", p, 0, tables[i]) for i, p in enumerate(prompts)]
    batched = engine.forward(steps)
    for i in range(len(prompts)):
        torch.testing.assert_close(batched[i], alone[i], rtol=0, atol=1e-5)
    toks = [int(r.argmax()) for r in batched]
    dec = engine.forward(
        [StepInput(f"m{i}", [toks[i]], len(p), tables[i]) for i, p in enumerate(prompts)]
    )
    for i, p in enumerate(prompts):
        lone = _logits_unsplit(
            engine, [*p, toks[i]], list(range(230, 230 + -(-(len(p) + 1) // BLOCK)))
        )
        torch.testing.assert_close(dec[i], lone, rtol=0, atol=1e-5)


def test_generate_batched_equals_single_and_frees_blocks(engine: Engine) -> None:
    rng = random.Random(11)
    vocab = engine.model_config.vocab_size
    prompts = [_prompt(rng, n, vocab) for n in (3, 40, 12, 25, 7)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    free_before = engine.block_manager.num_free_blocks
    together = generate(engine, prompts, params, prefill_chunk_tokens=16)
    for p, out in zip(prompts, together, strict=True):
        single = generate(engine, [p], params)[0]
        assert out.token_ids == single.token_ids
        assert len(out.token_ids) == 12 and out.finish_reason == "length"
    assert engine.block_manager.num_free_blocks == free_before
    engine.block_manager.check_integrity()


def test_seeded_sampling_is_deterministic_and_batch_independent(engine: Engine) -> None:
    rng = random.Random(5)
    vocab = engine.model_config.vocab_size
    prompts = [_prompt(rng, 9, vocab), _prompt(rng, 21, vocab)]
    params = SamplingParams(
        max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True
    )
    a = generate(engine, prompts, params)
    b = generate(engine, prompts[1:], params)
    assert a[1].token_ids == b[0].token_ids
    other = generate(
        engine,
        prompts[1:],
        SamplingParams(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True),
    )
    assert other[0].token_ids != b[0].token_ids


def test_preemption_when_pool_is_short() -> None:
    small = Engine.load(EngineConfig(model="tiny", block_size=BLOCK, num_kv_blocks=12))
    big = Engine.load(EngineConfig(model="tiny", block_size=BLOCK, num_kv_blocks=256))
    rng = random.Random(2)
    prompts = [_prompt(rng, 10, small.model_config.vocab_size) for _ in range(4)]
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    got = generate(small, prompts, params)
    want = generate(big, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert small.block_manager.num_free_blocks == 12


@pytest.mark.parametrize("chunk_tokens", [5, 16, 64])
def test_prompts_sharing_an_iteration_on_a_short_pool(chunk_tokens: int) -> None:
    """Several prompts are prefilled per iteration (token budget), chunked, and preempted
    (prefilling ones too) when the pool runs short: outputs equal a roomy engine's."""
    small = Engine.load(EngineConfig(model="tiny", block_size=BLOCK, num_kv_blocks=12))
    big = Engine.load(EngineConfig(model="tiny", block_size=BLOCK, num_kv_blocks=256))
    rng = random.Random(chunk_tokens)
    prompts = [_prompt(rng, n, small.model_config.vocab_size) for n in (7, 20, 3, 26, 11)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    got = generate(small, prompts, params, prefill_chunk_tokens=chunk_tokens)
    want = generate(big, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert small.block_manager.num_free_blocks == 12
    small.block_manager.check_integrity()


def test_stop_token_and_eos(engine: Engine) -> None:
    rng = random.Random(4)
    p = _prompt(rng, 8, engine.model_config.vocab_size)
    free_run = generate(engine, [p], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
    stop_tok = free_run[4]
    cut = generate(engine, [p], SamplingParams(max_tokens=10, stop_token_ids=(stop_tok,)))[0]
    first = free_run.index(stop_tok)
    assert cut.token_ids == free_run[: first + 1] and cut.finish_reason == "stop"


def test_bad_input_is_typed(engine: Engine) -> None:
    with pytest.raises(ContextLengthError, match="context limit"):
        generate(engine, [[5] * (engine.max_model_len + 3)], SamplingParams(max_tokens=1))
    with pytest.raises(ContextLengthError, match="empty"):
        generate(engine, [[]], SamplingParams(max_tokens=1))
    tiny_pool = Engine.load(EngineConfig(model="tiny", block_size=BLOCK, num_kv_blocks=2))
    with pytest.raises(NoFreeBlocksError):
        generate(tiny_pool, [[5] * 20], SamplingParams(max_tokens=1))
    assert tiny_pool.block_manager.num_free_blocks == 2
