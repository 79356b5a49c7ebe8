"""KVArena: block-major layout, byte views of block runs, zeroing, for every CPU dtype."""

from __future__ import annotations

import pytest
import torch

from shared.engine.kv_arena import KVArena

LAYERS, HEADS, DIM, BLOCK = 3, 2, 8, 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_layout_views_and_zeroing(dtype: torch.dtype) -> None:
    arena = KVArena(16, LAYERS, HEADS, DIM, BLOCK, dtype)
    assert arena.tensor.dtype == dtype and arena.tensor.is_contiguous()
    assert arena.tensor.shape == (16, LAYERS, 2, BLOCK, HEADS, DIM)
    elem = torch.empty((), dtype=dtype).element_size()
    assert arena.block_nbytes == LAYERS * 2 * BLOCK * HEADS * DIM * elem
    assert arena.total_nbytes == 16 * arena.block_nbytes
    # A write through one layer's view lands inside that block's byte range, nowhere else.
    arena.layer_view(1)[5, 0, 2] = 1.5
    touched = [b for b in range(16) if bool(arena.block_bytes(b).any())]
    assert touched == [5]
    run = arena.run_bytes(4, 3)
    assert run.dtype == torch.uint8 and run.numel() == 3 * arena.block_nbytes
    assert run.data_ptr() == arena.tensor[4].data_ptr()
    arena.zero_blocks([5])
    assert not bool(arena.tensor.view(torch.uint8).any())
    with pytest.raises(IndexError):
        arena.run_bytes(15, 2)
