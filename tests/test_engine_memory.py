"""KV arena sizing from --gpu-memory-utilization (shared/engine/memory.py). The device
query is mocked on CPU (a GPU is the one thing tests may mock); the real one runs with
CUDA."""

from __future__ import annotations

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.memory import MemoryBudgetError, kv_budget_bytes

GIB = 1 << 30


def test_budget_is_the_fraction_minus_what_is_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _d=None: (60 * GIB, 80 * GIB))
    cuda = torch.device("cuda", 0)
    assert kv_budget_bytes(cuda, 0.9) == int(0.9 * 80 * GIB) - 20 * GIB
    with pytest.raises(MemoryBudgetError, match="leaves no room"):
        kv_budget_bytes(cuda, 0.2)  # 16 GiB allowed, 20 GiB already in use


def test_cpu_refuses_the_fraction() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        kv_budget_bytes(torch.device("cpu"), 0.5)
    with pytest.raises(ValueError, match="CUDA"):
        EngineConfig(model="tiny", gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        EngineConfig(model="tiny", device="cuda", gpu_memory_utilization=1.5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_arena_fills_the_fraction_on_cuda() -> None:
    engine = Engine.load(EngineConfig(model="tiny", device="cuda", gpu_memory_utilization=0.3))
    free, total = torch.cuda.mem_get_info()
    used = total - free
    # The arena took what the fraction allowed: this process now uses about 30 % of the
    # device (within a block and the allocator's rounding).
    assert engine.arena.num_blocks > 1
    assert used <= 0.3 * total + engine.arena.block_nbytes + (64 << 20)
