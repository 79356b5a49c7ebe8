"""CUDA paths (skipped without CUDA), on the GPU-shaped ``tiny-gpu`` model (head_dim 128,
GQA 4, bf16 by default on CUDA): FlashInfer attention equals the torch reference on the same
strided arena for prefill, chunked prefill on cached context and mixed decode batches, and
greedy output is the same with either backend."""

from __future__ import annotations

import random

import pytest
import torch

from shared.engine.batch import StepInput
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.generate import generate
from shared.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MODEL = "tiny-gpu"
# bf16 keeps 8 bits of mantissa; the two backends sum in different orders. Logits here have
# a std near 10, so 0.1 absolute is ~1% of their spread.
BF16_TOL = {"rtol": 2e-2, "atol": 1e-1}


def _engine(backend: str) -> Engine:
    return Engine.load(
        EngineConfig(model=MODEL, device="cuda", num_kv_blocks=256, attention_backend=backend)
    )


def _engines() -> tuple[Engine, Engine]:
    pytest.importorskip("flashinfer")
    fi, ref = _engine("flashinfer"), _engine("torch")
    assert fi.model.attention.name == "flashinfer"
    assert fi.cfg.dtype == "bfloat16" and fi.model_config.head_dim == 128
    return fi, ref


def test_auto_dtype_is_bf16_on_cuda() -> None:
    eng = _engine("torch")
    assert eng.cfg.dtype == "bfloat16" and eng.arena.tensor.dtype == torch.bfloat16
    assert eng.arena.tensor.is_cuda


def test_flashinfer_matches_torch_on_cuda() -> None:
    fi, ref = _engines()
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 300) for _ in range(n)] for n in (5, 37, 64, 3)]
    for eng in (fi, ref):
        eng.forward(
            [
                StepInput(f"s{i}", p[: len(p) // 2 or 1], 0, list(range(i * 8, i * 8 + 8)))
                for i, p in enumerate(prompts)
            ]
        )
    outs = []
    for eng in (fi, ref):
        steps = [
            StepInput(
                f"s{i}",
                p[len(p) // 2 or 1 :] or [7],
                len(p) // 2 or 1,
                list(range(i * 8, i * 8 + 8)),
            )
            for i, p in enumerate(prompts)
        ]
        outs.append(eng.forward(steps))
    torch.testing.assert_close(outs[0].float(), outs[1].float(), **BF16_TOL)
    # Then a pure decode batch (the decode wrapper) on the same cached context.
    decode = [
        StepInput(f"s{i}", [11], len(p), list(range(i * 8, i * 8 + 8)))
        for i, p in enumerate(prompts)
    ]
    a, b = fi.forward(decode), ref.forward(decode)
    torch.testing.assert_close(a.float(), b.float(), **BF16_TOL)


def test_greedy_generation_is_the_same_with_either_backend() -> None:
    fi, ref = _engines()
    rng = random.Random(1)
    prompts = [[rng.randrange(4, 300) for _ in range(n)] for n in (9, 30, 50)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    assert [o.token_ids for o in generate(fi, prompts, params)] == [
        o.token_ids for o in generate(ref, prompts, params)
    ]


def test_torch_backend_in_bf16_on_cuda_tracks_fp32_on_cpu() -> None:
    """Runs without FlashInfer too: the bf16 CUDA engine (torch attention on the strided
    arena) against the fp32 CPU engine on the same bf16-stored weights."""
    gpu = _engine("torch")
    cpu = Engine.load(EngineConfig(model=MODEL, num_kv_blocks=256))
    assert cpu.cfg.dtype == "float32"
    rng = random.Random(2)
    prompts = [[rng.randrange(4, 300) for _ in range(n)] for n in (7, 40)]
    steps = [StepInput(f"s{i}", p, 0, list(range(i * 8, i * 8 + 8))) for i, p in enumerate(prompts)]
    a, b = gpu.forward(steps).float().cpu(), cpu.forward(steps)
    # bf16 activations through 4 layers: ~1% of a logit spread near 10.
    torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-1)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
