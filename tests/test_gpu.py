"""CUDA paths (skipped without CUDA): FlashInfer attention equals the torch reference on the
same arena for prefill, chunked prefill on cached context and mixed decode batches."""

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


def _engines() -> tuple[Engine, Engine]:
    pytest.importorskip("flashinfer")
    fi = Engine.load(
        EngineConfig(model="tiny", device="cuda", num_kv_blocks=256, attention_backend="flashinfer")
    )
    ref = Engine.load(
        EngineConfig(model="tiny", device="cuda", num_kv_blocks=256, attention_backend="torch")
    )
    assert fi.model.attention.name == "flashinfer"
    return fi, ref


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
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-3, atol=1e-3)


def test_greedy_generation_matches_cpu_reference() -> None:
    fi, _ = _engines()
    cpu = Engine.load(EngineConfig(model="tiny", num_kv_blocks=256))
    rng = random.Random(1)
    prompts = [[rng.randrange(4, 300) for _ in range(n)] for n in (9, 30, 50)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    assert [o.token_ids for o in generate(fi, prompts, params)] == [
        o.token_ids for o in generate(cpu, prompts, params)
    ]
