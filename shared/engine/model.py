"""Llama-family decoder (Llama, Qwen2, Qwen3 dense) over a paged KV arena.

Plain tensors, no nn.Module: the weights are read-only after construction and the forward
pass is a handful of projections per layer. q/k/v are fused into one matrix (one pass over
the activations); projections run through ``Linear`` (linear.py), which on CPU uses oneDNN
weights packed once at load and fuses the residual add, SiLU and gate multiply into the
projection calls. A decode step is bandwidth-bound on weights *and*, at 30 small layers,
bound by the number of dispatched ops: each layer is ~15 ops (norm, qkv, RoPE on q and k at
once, KV write + attention, o+residual, norm, gate+SiLU, up*gate, down+residual).

Numerics follow HF transformers' implementation (RMSNorm in fp32, rotate-half RoPE, SiLU
gated MLP) so that greedy tokens match it exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.engine.attention_backend import AttentionBackend
from shared.engine.batch import ForwardBatch
from shared.engine.config import ModelConfig
from shared.engine.linear import Linear, resolve_kernel
from shared.errors import ModelLoadError


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: Linear  # q, k, v fused: [(Hq + 2 Hkv) * D] outputs
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    post_norm: torch.Tensor
    gate: Linear
    up: Linear
    down: Linear


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, including Llama-3 style ``rope_scaling`` when configured."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = dict(cfg.rope_scaling)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind != "llama3":
        raise ModelLoadError(f"rope_scaling type {kind!r} is not supported (supported: llama3)")
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: statistics in fp32, scale in the model dtype (no casts when fp32)."""
    if x.dtype == torch.float32:
        # One fused op instead of seven (two rms norms per layer per decode step).
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(eps))
    return weight * x32.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE ``x * cos + rotate_half(x) * sin`` in three ops. x: ``[T, H, D]``.

    ``rotate_half(x) = [-x2, x1]``: the halves are swapped by a roll over D and the sign
    lives in ``sin_signed = [-sin1, sin2]``.
    """
    return (x * cos).addcmul_(x.roll(x.shape[-1] // 2, -1), sin_signed)


class LlamaModel:
    """Immutable weights + a forward pass. ``forward`` mutates only the KV arena."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        attention: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        linear_kernel: str = "auto",
    ) -> None:
        self.cfg = cfg
        self.attention = attention
        self.dtype = dtype
        self.linear_kernel = resolve_kernel(linear_kernel, device, dtype)

        def w(name: str) -> torch.Tensor:
            try:
                return weights[name].to(device=device, dtype=dtype).contiguous()
            except KeyError:
                raise ModelLoadError(f"weight {name!r} missing from the model files") from None

        def opt(name: str) -> torch.Tensor | None:
            return w(name) if name in weights else None

        def lin(names: list[str], bias: torch.Tensor | None = None) -> Linear:
            weight = torch.cat([w(n) for n in names]) if len(names) > 1 else w(names[0])
            return Linear(weight, bias, self.linear_kernel)

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = Linear(
            self.embed if cfg.tie_word_embeddings else w("lm_head.weight"), None, self.linear_kernel
        )
        self.final_norm = w("model.norm.weight")
        self.layers: list[_Layer] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if cfg.qkv_bias:
                bias = torch.cat([w(a + "q_proj.bias"), w(a + "k_proj.bias"), w(a + "v_proj.bias")])
            self.layers.append(
                _Layer(
                    input_norm=w(p + "input_layernorm.weight"),
                    qkv=lin([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"], bias),
                    q_norm=opt(a + "q_norm.weight") if cfg.qk_norm else None,
                    k_norm=opt(a + "k_norm.weight") if cfg.qk_norm else None,
                    o=lin([a + "o_proj.weight"]),
                    post_norm=w(p + "post_attention_layernorm.weight"),
                    gate=lin([p + "mlp.gate_proj.weight"]),
                    up=lin([p + "mlp.up_proj.weight"]),
                    down=lin([p + "mlp.down_proj.weight"]),
                )
            )
        inv_freq = rope_inv_freq(cfg)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        half = cfg.head_dim // 2
        self.cos = emb.cos().to(device=device, dtype=dtype)
        sin = emb.sin()
        sin[:, :half] = -sin[:, :half]
        self.sin_signed = sin.to(device=device, dtype=dtype)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    def weight_nbytes(self) -> int:
        """Bytes a forward pass reads from weights (lm_head counted once if tied)."""
        elem = self.embed.element_size()
        total = self.lm_head.nbytes + self.final_norm.numel() * elem
        for layer in self.layers:
            total += sum(
                lin.nbytes for lin in (layer.qkv, layer.o, layer.gate, layer.up, layer.down)
            )
            total += (layer.input_norm.numel() + layer.post_norm.numel()) * elem
        return total

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_layers: list[torch.Tensor]) -> torch.Tensor:
        """Run the model on ``batch``; returns fp32 logits ``[num_seqs, vocab]``.

        Mutates ``kv_layers`` (per-layer arena views): writes the new tokens' K/V.
        """
        cfg = self.cfg
        d = cfg.head_dim
        eps = cfg.rms_norm_eps
        hq, hkv = cfg.num_heads, cfg.num_kv_heads
        qk_size = self.q_size + self.kv_size
        x = F.embedding(batch.input_ids, self.embed)
        cos = self.cos[batch.positions].unsqueeze(1)
        sin = self.sin_signed[batch.positions].unsqueeze(1)
        num_tokens = x.shape[0]
        for layer, kv_layer in zip(self.layers, kv_layers, strict=True):
            qkv = layer.qkv(_rms_norm(x, layer.input_norm, eps))
            # q and k side by side ([T, Hq + Hkv, D]) so RoPE runs once for both.
            qk = qkv[:, :qk_size].view(num_tokens, hq + hkv, d)
            if layer.q_norm is not None and layer.k_norm is not None:
                qk = torch.cat(
                    (
                        _rms_norm(qk[:, :hq], layer.q_norm, eps),
                        _rms_norm(qk[:, hq:], layer.k_norm, eps),
                    ),
                    dim=1,
                )
            qk = _rope(qk, cos, sin)
            v = qkv[:, qk_size:].view(num_tokens, hkv, d)
            attn = self.attention(qk[:, :hq], qk[:, hq:], v, kv_layer, batch)
            x = layer.o.add(attn.reshape(num_tokens, self.q_size), x)
            h = _rms_norm(x, layer.post_norm, eps)
            x = layer.down.add(layer.up.mul(h, layer.gate.silu(h)), x)
        last = _rms_norm(x[batch.logits_indices], self.final_norm, eps)
        return self.lm_head(last).float()
