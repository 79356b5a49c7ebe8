"""Paged attention backends.

``TorchPagedAttention`` (CPU, or any device): writes the new tokens' K/V into the arena, then
gathers each sequence's context through its block table and runs SDPA. Pure decode batches
(batch 1 included) are gathered into a padded ``[B, max_ctx]`` tensor through block tables
built once per step (``ForwardBatch.decode_tables``) and run as one SDPA call; batches
with prompt chunks run one SDPA per sequence with a causal mask offset by the cached context
(so a chunked prefill on top of existing KV sees exactly what an unsplit prefill sees).

``FlashInferPagedAttention`` (CUDA) lives in flashinfer_backend.py and is chosen by
``make_attention`` when CUDA and flashinfer are both available. The contract both meet
(``AttentionBackend``, ``write_kv``) is attention_backend.py, which both import.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.engine.attention_backend import AttentionBackend, write_kv
from shared.engine.batch import ForwardBatch


class TorchPagedAttention:
    name = "torch"

    def __init__(self, scale: float) -> None:
        self.scale = scale
        # [2, max_blocks, bs, Hkv, D]: where prompt chunks gather their context. Carved from
        # the KV arena when the worker takes the prefill role (Engine.reslice); None: each
        # gather allocates (large ones cost fresh pages every layer).
        self.workspace: torch.Tensor | None = None

    def workspace_nbytes(self, max_context_len: int, kv_layer_shape: torch.Size, elt: int) -> int:
        """Bytes a workspace needs to gather one layer's K and V of ``max_context_len``."""
        _, _, bs, hkv, d = kv_layer_shape
        return 2 * -(-max_context_len // bs) * bs * hkv * d * elt

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        write_kv(kv_layer, k, v, batch)
        if batch.decode_tables is not None:
            return self._decode(q, kv_layer, batch)
        out = torch.empty_like(q)
        for span in batch.spans:
            keys, values = _gather(kv_layer, span.block_table, span.context_len, self.workspace)
            qs = q[span.q_start : span.q_start + span.q_len].transpose(0, 1)  # [Hq, q, D]
            mask = None
            if span.q_len > 1:
                # Query i sits at absolute position ctx - q_len + i and sees keys <= it.
                q_pos = torch.arange(span.context_len - span.q_len, span.context_len)
                mask = q_pos[:, None] >= torch.arange(span.context_len)[None, :]
                mask = mask.to(q.device)
            o = F.scaled_dot_product_attention(
                qs, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
            )
            out[span.q_start : span.q_start + span.q_len] = o.transpose(0, 1)
        return out

    def _decode(self, q: torch.Tensor, kv_layer: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Every sequence has one query: gather all contexts, padded, in one SDPA call.

        K and V are gathered separately straight from the strided layer view (two copies of
        exactly the context, no intermediate ``[.., 2, ..]`` tensor to split again).
        """
        tables = batch.decode_tables
        assert tables is not None
        b, nb = tables.shape
        _, _, bs, hkv, d = kv_layer.shape
        n = batch.decode_max_context_len
        # index_select, not advanced indexing: the same copy at a third of the cost
        # (~8 vs ~20 us per layer at batch 1; this runs twice per layer per step).
        flat = tables.reshape(-1)
        keys = torch.index_select(kv_layer[:, 0], 0, flat)
        values = torch.index_select(kv_layer[:, 1], 0, flat)
        keys = keys.view(b, nb * bs, hkv, d)[:, :n].transpose(1, 2)
        values = values.view(b, nb * bs, hkv, d)[:, :n].transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            keys,
            values,
            attn_mask=batch.decode_mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return o.squeeze(2)


def _gather(
    kv_layer: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    workspace: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous K and V ``[Hkv, context_len, D]`` of one sequence, gathered into
    ``workspace`` (overwritten; valid until the next gather) when it is large enough."""
    nb = block_table.shape[0]
    _, _, bs, hkv, d = kv_layer.shape
    if workspace is not None and nb <= workspace.shape[1]:
        keys = torch.index_select(kv_layer[:, 0], 0, block_table, out=workspace[0, :nb])
        values = torch.index_select(kv_layer[:, 1], 0, block_table, out=workspace[1, :nb])
    else:
        keys, values = kv_layer[:, 0][block_table], kv_layer[:, 1][block_table]
    keys = keys.view(nb * bs, hkv, d)[:context_len].transpose(0, 1)
    values = values.view(nb * bs, hkv, d)[:context_len].transpose(0, 1)
    return keys, values


def make_attention(backend: str, device: torch.device, scale: float) -> AttentionBackend:
    """Pick the attention backend: ``auto`` = FlashInfer on CUDA when importable, else torch.

    Raises ValueError if ``flashinfer`` is asked for and cannot be used.
    """
    if backend in ("auto", "flashinfer") and device.type == "cuda":
        try:
            from shared.engine.flashinfer_backend import FlashInferPagedAttention

            return FlashInferPagedAttention(scale, device)
        except ImportError:
            if backend == "flashinfer":
                raise ValueError(
                    "attention_backend=flashinfer but flashinfer is not installed"
                ) from None
    if backend == "flashinfer":
        raise ValueError("attention_backend=flashinfer needs a CUDA device")
    return TorchPagedAttention(scale)
