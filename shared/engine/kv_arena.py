"""The KV arena: one preallocated tensor per worker holding every KV block.

Layout: ``[num_blocks, num_layers, 2 (k, v), block_size, num_kv_heads, head_dim]``.

Why block-major (all layers of a block contiguous) rather than layer-major: one block is
then one contiguous byte range, and a run of consecutive block ids is one contiguous range
too, so the transfer layer moves a run of blocks as a single UCX message straight into the
receiver's arena, whatever the number of layers. Attention reads one layer at a time through
a strided view (``layer_view``); on CPU it gathers by block table, and FlashInfer's paged
kernels accept the per-layer view as a strided ``[pages, 2, page_size, heads, dim]`` tensor.

The arena owns bytes only. Which block belongs to whom is the BlockManager's business.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch


class KVArena:
    """Preallocated KV storage. Mutates only the bytes of the blocks it is asked to write."""

    def __init__(
        self,
        num_blocks: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
        if torch.device(device).type == "cpu":
            # numpy asks the kernel for transparent huge pages on large buffers; torch's CPU
            # allocator does not, and UCX's shared-memory copy runs ~2x slower on 4 KiB pages.
            # Bytes from numpy, viewed as any torch dtype (bfloat16 has no numpy twin).
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            raw = torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))
            self.tensor = raw.view(dtype).view(shape)
        else:
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.block_nbytes = self.tensor[0].numel() * self.tensor.element_size()

    @property
    def total_nbytes(self) -> int:
        return self.block_nbytes * self.num_blocks

    @property
    def layout(self) -> str:
        return "block-major[num_blocks,num_layers,2,block_size,num_kv_heads,head_dim]"

    def layer_view(self, layer: int) -> torch.Tensor:
        """Strided view ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` of one layer."""
        return self.tensor[:, layer]

    def run_bytes(self, first_block: int, num_blocks: int) -> torch.Tensor:
        """A contiguous uint8 view over blocks ``first_block .. first_block+num_blocks-1``."""
        if first_block < 0 or num_blocks <= 0 or first_block + num_blocks > self.num_blocks:
            raise IndexError(f"block run {first_block}+{num_blocks} outside arena")
        run = self.tensor[first_block : first_block + num_blocks]
        assert run.is_contiguous()
        return run.view(-1).view(torch.uint8)

    def block_bytes(self, block_id: int) -> torch.Tensor:
        return self.run_bytes(block_id, 1)

    def zero_blocks(self, block_ids: Sequence[int]) -> None:
        """Overwrite the given blocks with zeros (``kv_zero_on_free``)."""
        if block_ids:
            self.tensor[torch.as_tensor(list(block_ids), device=self.tensor.device)] = 0


def contiguous_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split a block table into runs of consecutive ids.

    Returns ``(logical_index, first_block_id, num_blocks)`` triples in logical order.
    """
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(block_ids) + 1):
        if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
            runs.append((start, block_ids[start], i - start))
            start = i
    return runs
