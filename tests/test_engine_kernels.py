"""Projection kernels (shared/engine/linear.py) and the engine built on each of them."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F

from shared.engine.batch import StepInput
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.generate import generate
from shared.engine.linear import Linear, onednn_usable, resolve_kernel
from shared.sampling_params import SamplingParams

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not onednn_usable(CPU, torch.float32), reason="torch built without oneDNN"
)


def _kernels() -> list[str]:
    return ["mm", "onednn"] if onednn_usable(CPU, torch.float32) else ["mm"]


@pytest.mark.parametrize("kernel", _kernels())
@pytest.mark.parametrize("rows", [1, 3, 8, 37])
def test_linear_ops_match_reference(kernel: str, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 32, generator=gen)
    bias = torch.randn(48, generator=gen)
    x = torch.randn(rows, 32, generator=gen)
    other = torch.randn(rows, 48, generator=gen)
    other_before = other.clone()
    ref = x @ weight.t()
    tol = {"atol": 1e-4, "rtol": 1e-5}
    torch.testing.assert_close(Linear(weight, bias, kernel)(x), ref + bias, **tol)
    plain = Linear(weight, None, kernel)
    torch.testing.assert_close(plain(x), ref, **tol)
    torch.testing.assert_close(plain.add(x, other), other + ref, **tol)
    torch.testing.assert_close(plain.silu(x), F.silu(ref), **tol)
    torch.testing.assert_close(plain.mul(x, other), other * ref, **tol)
    assert torch.equal(other, other_before)  # add / mul never write into their operand
    assert plain.nbytes == weight.numel() * 4


def test_resolve_kernel() -> None:
    assert resolve_kernel("mm", CPU, torch.float32) == "mm"
    assert resolve_kernel("auto", CPU, torch.float16) == "mm"
    with pytest.raises(ValueError, match="linear kernel"):
        resolve_kernel("blas", CPU, torch.float32)
    with pytest.raises(ValueError, match="onednn cannot run"):
        resolve_kernel("onednn", CPU, torch.float16)


@needs_onednn
def test_engines_on_both_kernels_agree() -> None:
    """Same greedy tokens and near-identical logits on both kernels, for prefill, a
    mixed-length decode batch and a batch-1 decode."""
    engines = {
        k: Engine.load(
            EngineConfig(
                model="tiny", block_size=4, num_kv_blocks=64, extra=(("linear_kernel", k),)
            )
        )
        for k in ("mm", "onednn")
    }
    assert {k: e.describe()["linear_kernel"] for k, e in engines.items()} == {
        "mm": "mm",
        "onednn": "onednn",
    }
    rng = random.Random(7)
    vocab = engines["mm"].model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 11, 2)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = {k: [o.token_ids for o in generate(e, prompts, params)] for k, e in engines.items()}
    assert outs["mm"] == outs["onednn"]
    logits = {
        k: e.forward([StepInput("s", prompts[1], 0, list(range(3)))]) for k, e in engines.items()
    }
    torch.testing.assert_close(logits["mm"], logits["onednn"], atol=1e-4, rtol=1e-4)


def test_bench_engine_reports_both_goal_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    from services.bench.engine import main

    argv = ["--model", "tiny", "--no-hf", "--prompt-len", "8", "--decode-iters", "2"]
    assert main([*argv, "--new-tokens", "3", "--threads", "1", "--omp-wait-policy", "inherit"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["goal_threads"] == 1
    assert last["b1_step_over_floor"] == last["t1"]["b1_step_over_floor"] > 0
    assert last["decode_floor_ms"] > 0 and last["t2"]["decode_b8_tokens_per_s"] > 0
    assert last["linear_kernel"] in ("mm", "onednn")
