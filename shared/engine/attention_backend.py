"""What every paged attention backend is: the ``AttentionBackend`` contract and the one
way new tokens' K/V are written into the arena.

Both backends (attention.py: torch; flashinfer_backend.py: CUDA) import it, and the model
holds a backend by this type; the choice between them is ``attention.make_attention``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from shared.engine.batch import ForwardBatch


class AttentionBackend(Protocol):
    name: str

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] (new tokens); kv_layer: [blocks, 2, bs, Hkv, D].

        Mutates kv_layer (writes the new K/V). Returns attention output [T, Hq, D].
        """
        ...


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> None:
    """Store the new tokens' K/V at their (block, offset) slots. Mutates ``kv_layer``."""
    kv_layer[batch.slot_blocks, 0, batch.slot_offsets] = k
    kv_layer[batch.slot_blocks, 1, batch.slot_offsets] = v
