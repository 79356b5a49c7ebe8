"""FlashInfer paged attention (CUDA). Chosen by ``make_attention`` when CUDA and flashinfer
are both available; the torch backend is the reference it is tested against.

The arena's per-layer view ``[num_blocks, 2, block_size, kv_heads, head_dim]`` is FlashInfer's
NHD paged layout with a page stride of ``num_layers`` pages (block-major arena). One plan is
made per batch *layout* and reused by every layer and by later batches of the same layout.
Pure decode batches use the decode wrapper; anything with prompt chunks uses the prefill
wrapper with ``causal=True``, whose mask is aligned to the end of each sequence's KV, which
is exactly a chunked prefill on top of cached context.

Plan cache: a plan depends only on the batch's contents (query lengths, context lengths,
page tables) and the head shapes/dtypes, so that tuple is the key (``PlanKey``). Keying by
``id(batch)`` was wrong: CPython reuses the id of a freed batch for the next one, whose
pages differ, and the stale plan would then read another request's KV.

CUDA graphs for decode are not used: the decode wrapper would need its CUDA-graph mode
(fixed-size index buffers per captured batch size) and every per-layer op captured too;
whether that pays depends on the launch overhead at our batch sizes, which nobody has
measured on a GPU here yet (scripts/gpu_check.sh's engine bench is the place to look first).
"""

from __future__ import annotations

from typing import Any

import torch

from shared.engine.attention_backend import write_kv
from shared.engine.batch import ForwardBatch

_WORKSPACE_BYTES = 128 * 1024 * 1024

PlanKey = tuple[Any, ...]


def plan_key(batch: ForwardBatch, q: torch.Tensor, kv_layer: torch.Tensor) -> PlanKey:
    """Everything a FlashInfer plan depends on, as a hashable tuple (no device reads)."""
    return (
        batch.all_decode,
        tuple(q.shape[1:]),
        tuple(kv_layer.shape[2:]),
        q.dtype,
        kv_layer.dtype,
        batch.layout_key,
    )


def plan_inputs(batch: ForwardBatch, block_size: int) -> tuple[list[int], ...]:
    """``(qo_indptr, kv_indptr, kv_indices, kv_last_page_len)`` from the batch's layout."""
    qo_indptr, kv_indptr = [0], [0]
    indices: list[int] = []
    last_len: list[int] = []
    for q_len, context_len, table in batch.layout_key:
        pages = -(-context_len // block_size)
        indices.extend(table[:pages])
        kv_indptr.append(kv_indptr[-1] + pages)
        last_len.append(context_len - (pages - 1) * block_size)
        qo_indptr.append(qo_indptr[-1] + q_len)
    return qo_indptr, kv_indptr, indices, last_len


class FlashInferPagedAttention:
    """Mutates the arena (writes the new tokens' KV) and its wrappers' plans."""

    name = "flashinfer"

    def __init__(self, scale: float, device: torch.device) -> None:
        import flashinfer  # ImportError -> make_attention falls back to torch

        self.scale = scale
        self.device = device
        self._workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        # One plan per wrapper: a decode batch after a prefill batch of the same step keeps
        # the decode plan it had.
        self._planned: dict[bool, PlanKey] = {}
        self.num_plans = 0  # plans made (tests and benches read it)

    def _plan(self, batch: ForwardBatch, q: torch.Tensor, kv_layer: torch.Tensor) -> None:
        block_size = kv_layer.shape[2]
        num_kv_heads, head_dim = kv_layer.shape[3], kv_layer.shape[4]
        num_qo_heads = q.shape[1]
        qo_indptr, indptr, indices, last_len = plan_inputs(batch, block_size)
        dev = self.device

        def i32(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int32, device=dev)

        common = {
            "sm_scale": self.scale,
            "q_data_type": q.dtype,
            "kv_data_type": kv_layer.dtype,
        }
        kv_args = (i32(indptr), i32(indices), i32(last_len))
        shape_args = (num_qo_heads, num_kv_heads, head_dim, block_size)
        if batch.all_decode:
            self._decode.plan(*kv_args, *shape_args, **common)
        else:
            self._prefill.plan(i32(qo_indptr), *kv_args, *shape_args, causal=True, **common)
        self.num_plans += 1

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        write_kv(kv_layer, k, v, batch)
        key = plan_key(batch, q, kv_layer)
        if self._planned.get(batch.all_decode) != key:
            self._plan(batch, q, kv_layer)
            self._planned[batch.all_decode] = key
        wrapper = self._decode if batch.all_decode else self._prefill
        return wrapper.run(q.contiguous(), kv_layer)
