"""FlashInfer paged attention (CUDA). Chosen by ``make_attention`` when CUDA and flashinfer
are both available; the torch backend is the reference it is tested against.

The arena's per-layer view ``[num_blocks, 2, block_size, kv_heads, head_dim]`` is FlashInfer's
NHD paged layout with a page stride of ``num_layers`` pages (block-major arena). One plan is
made per forward batch (page table, query offsets) and reused by every layer.
Pure decode batches use the decode wrapper; anything with prompt chunks uses the prefill
wrapper with ``causal=True``, whose mask is aligned to the end of each sequence's KV, which
is exactly a chunked prefill on top of cached context.
"""

from __future__ import annotations

import torch

from shared.engine.attention import write_kv
from shared.engine.batch import ForwardBatch

_WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferPagedAttention:
    name = "flashinfer"

    def __init__(self, scale: float, device: torch.device) -> None:
        import flashinfer  # ImportError -> make_attention falls back to torch

        self.scale = scale
        self.device = device
        self._workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._planned_for: int | None = None

    def _plan(self, batch: ForwardBatch, q: torch.Tensor, kv_layer: torch.Tensor) -> None:
        block_size = kv_layer.shape[2]
        num_kv_heads, head_dim = kv_layer.shape[3], kv_layer.shape[4]
        num_qo_heads = q.shape[1]
        indptr = [0]
        indices: list[torch.Tensor] = []
        last_len = []
        qo_indptr = [0]
        for span in batch.spans:
            pages = -(-span.context_len // block_size)
            indices.append(span.block_table[:pages])
            indptr.append(indptr[-1] + pages)
            last_len.append(span.context_len - (pages - 1) * block_size)
            qo_indptr.append(qo_indptr[-1] + span.q_len)
        dev = self.device
        kv_indptr = torch.tensor(indptr, dtype=torch.int32, device=dev)
        kv_indices = torch.cat(indices).to(device=dev, dtype=torch.int32)
        kv_last = torch.tensor(last_len, dtype=torch.int32, device=dev)
        if batch.all_decode:
            self._decode.plan(
                kv_indptr,
                kv_indices,
                kv_last,
                num_qo_heads,
                num_kv_heads,
                head_dim,
                block_size,
                sm_scale=self.scale,
                q_data_type=q.dtype,
                kv_data_type=kv_layer.dtype,
            )
        else:
            self._prefill.plan(
                torch.tensor(qo_indptr, dtype=torch.int32, device=dev),
                kv_indptr,
                kv_indices,
                kv_last,
                num_qo_heads,
                num_kv_heads,
                head_dim,
                block_size,
                causal=True,
                sm_scale=self.scale,
                q_data_type=q.dtype,
                kv_data_type=kv_layer.dtype,
            )
        self._planned_for = id(batch)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        write_kv(kv_layer, k, v, batch)
        if self._planned_for != id(batch):
            self._plan(batch, q, kv_layer)
        wrapper = self._decode if batch.all_decode else self._prefill
        return wrapper.run(q.contiguous(), kv_layer)
