"""FlashInfer plan-cache keying, on CPU: a stand-in ``flashinfer`` module whose wrappers
count plans and record their inputs (FlashInfer itself needs CUDA; tests/test_gpu.py runs
the real kernels). What is under test is our backend class: when it plans, and with what.
"""

from __future__ import annotations

import gc
import sys
import types
from typing import Any

import pytest
import torch

from shared.engine.batch import StepInput, build_batch
from shared.engine.flashinfer_backend import FlashInferPagedAttention, plan_inputs, plan_key

BS, HKV, D, HQ = 4, 2, 8, 4


class FakeWrapper:
    def __init__(self, workspace: torch.Tensor, layout: str) -> None:
        assert layout == "NHD"
        self.plans: list[tuple[Any, ...]] = []

    def plan(self, *args: Any, **kwargs: Any) -> None:
        self.plans.append(tuple(a.tolist() if isinstance(a, torch.Tensor) else a for a in args))

    def run(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(q)


@pytest.fixture
def attn(monkeypatch: pytest.MonkeyPatch) -> FlashInferPagedAttention:
    fake = types.ModuleType("flashinfer")
    fake.BatchDecodeWithPagedKVCacheWrapper = FakeWrapper  # type: ignore[attr-defined]
    fake.BatchPrefillWithPagedKVCacheWrapper = FakeWrapper  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    return FlashInferPagedAttention(0.5, torch.device("cpu"))


def kv_layer() -> torch.Tensor:
    return torch.zeros(32, 2, BS, HKV, D)


def step(attn: FlashInferPagedAttention, steps: list[StepInput], layers: int = 3) -> Any:
    batch = build_batch(steps, BS, torch.device("cpu"))
    n = batch.num_tokens
    for _ in range(layers):  # every layer of one forward calls the backend
        attn(
            torch.zeros(n, HQ, D), torch.zeros(n, HKV, D), torch.zeros(n, HKV, D), kv_layer(), batch
        )
    return batch


def test_one_plan_per_layout_not_per_layer_or_object(attn: FlashInferPagedAttention) -> None:
    prefill = [StepInput("a", [1] * 6, 0, [3, 4]), StepInput("b", [2] * 3, 5, [7, 9])]
    step(attn, prefill)
    assert attn.num_plans == 1  # three layers, one plan
    step(attn, list(prefill))  # a new batch object with the same contents
    assert attn.num_plans == 1
    assert attn._prefill.plans[0] == ([0, 6, 9], [0, 2, 4], [3, 4, 7, 9], [2, 4], HQ, HKV, D, BS)


def test_new_contents_replan_even_where_the_object_id_repeats(
    attn: FlashInferPagedAttention,
) -> None:
    ids = set()
    for i in range(6):  # each batch is freed before the next: CPython reuses ids
        batch = step(attn, [StepInput("a", [1], 4 + i, [3, 5, 8])], layers=2)
        ids.add(id(batch))
        del batch
        gc.collect()
    assert attn.num_plans == 6  # every context length differs: six plans
    last = attn._decode.plans[-1]
    assert last[:3] == ([0, 3], [3, 5, 8], [2])  # 10 tokens: pages 3,5,8, 2 in the last
    # Same lengths, other pages (another request in the same slot): must replan too.
    step(attn, [StepInput("b", [1], 9, [11, 12, 13])], layers=1)
    assert attn.num_plans == 7 and attn._decode.plans[-1][1] == [11, 12, 13]


def test_each_wrapper_keeps_its_plan(attn: FlashInferPagedAttention) -> None:
    decode = [StepInput("a", [1], 7, [1, 2]), StepInput("b", [1], 2, [5])]
    chunk = [StepInput("c", [3] * 5, 0, [8, 9])]
    for _ in range(3):  # decode, then a prompt chunk, alternating as a mixed worker does
        step(attn, decode)
        step(attn, chunk)
    assert len(attn._decode.plans) == 1 and len(attn._prefill.plans) == 1


def test_key_and_inputs_read_the_layout_only() -> None:
    steps = [StepInput("a", [1, 2, 3], 5, [4, 6, 0, 0]), StepInput("b", [9], 0, [2])]
    batch = build_batch(steps, BS, torch.device("cpu"))
    assert batch.layout_key == ((3, 8, (4, 6)), (1, 1, (2,)))
    assert plan_inputs(batch, BS) == ([0, 3, 4], [0, 2, 3], [4, 6, 2], [4, 1])
    q, kv = torch.zeros(4, HQ, D), kv_layer()
    assert plan_key(batch, q, kv) != plan_key(batch, q.to(torch.bfloat16), kv)
    assert plan_key(batch, q, kv) == plan_key(build_batch(steps, BS, torch.device("cpu")), q, kv)
