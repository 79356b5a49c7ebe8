"""Reference: our engine on smollm2-135m vs HF transformers on the same GGUF (fp32).

The two implementations share nothing but the file: HF dequantizes the GGUF with its own
integration and runs its own Llama code.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from shared.engine.batch import StepInput
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.generate import generate
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.reference

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers:",
]
NUM_TOKENS = 32


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load(EngineConfig(model="smollm2-135m", block_size=16, num_kv_blocks=128))


@pytest.fixture(scope="module")
def hf_model(engine: Engine):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    path = pathlib.Path(engine.model_source)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def _hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:  # type: ignore[no-untyped-def]
    out: list[int] = []
    with torch.no_grad():
        res = model(torch.tensor([ids]), use_cache=True)
        first_logits = res.logits[0, -1].float()
        past = res.past_key_values
        tok = int(first_logits.argmax())
        for _ in range(n):
            out.append(tok)
            res = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past = res.past_key_values
            tok = int(res.logits[0, -1].argmax())
    return out, first_logits


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_and_logits_match_hf(engine: Engine, hf_model, prompt: str) -> None:  # type: ignore[no-untyped-def]
    tok = engine.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))
    want, hf_logits = _hf_greedy(hf_model, ids, NUM_TOKENS)
    got = generate(engine, [ids], SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True))[0]
    assert got.token_ids == want
    table = list(range(-(-len(ids) // 16)))
    ours = engine.forward([StepInput("ref", ids, 0, table)])[0]
    assert float((ours - hf_logits).abs().max()) < 1e-3


def test_capital_of_france(engine: Engine) -> None:
    tok = engine.tokenizer
    ids = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    )
    out = generate(engine, [ids], SamplingParams(max_tokens=16))[0]
    assert tok.decode(out.token_ids).strip() == "The capital of France is Paris."
