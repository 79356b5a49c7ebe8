"""Model architecture config (read from model files) and engine config (chosen by the operator)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from shared.engine.defaults import DEFAULT_KV_CACHE_BYTES, check_device_name

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder. Immutable; derived from the model files.

    ``architecture`` is one of SUPPORTED_ARCHITECTURES. ``qkv_bias`` is Qwen2's bias on the
    q/k/v projections; ``qk_norm`` is Qwen3's per-head RMSNorm on q and k.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config field {name} must be > 0")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    def digest(self) -> str:
        """Stable hash of every architecture field (part of the KV fingerprint)."""
        blob = json.dumps(asdict(self), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def default_dtype(device: str) -> str:
    """The dtype "auto" means on ``device``: bfloat16 on CUDA, float32 elsewhere."""
    return "bfloat16" if str(device).startswith("cuda") else "float32"


@dataclass(frozen=True)
class EngineConfig:
    """What the operator chooses for one engine instance. Validated on construction.

    ``num_kv_blocks`` = 0 means: size the arena from ``kv_cache_bytes``. ``dtype`` "auto"
    is resolved here, once: bfloat16 on CUDA (FlashInfer's kernels take 16-bit or fp8, and
    bf16 halves KV bytes), float32 on CPU (torch's CPU bf16 matmuls are slower than fp32).
    """

    model: str = "tiny"
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int = 0
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    max_num_seqs: int = 64
    max_model_len: int = 0  # 0: the model's own limit
    # > 0: size the KV arena so that the process uses at most this fraction of the CUDA
    # device's memory (vLLM's flag); overrides kv_cache_bytes (num_kv_blocks overrides both).
    gpu_memory_utilization: float = 0.0
    num_threads: int = 0  # 0: leave torch's default
    kv_zero_on_free: bool = False
    attention_backend: str = "auto"  # auto | torch | flashinfer
    seed: int = 0
    extra: tuple[tuple[str, Any], ...] = field(default=())

    def __post_init__(self) -> None:
        check_device_name(self.device)
        if self.dtype == "auto":
            # Frozen: resolved once so every reader (fingerprint, arena, logs) sees one name.
            object.__setattr__(self, "dtype", default_dtype(self.device))
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks < 0 or self.kv_cache_bytes <= 0:
            raise ValueError("num_kv_blocks must be >= 0 and kv_cache_bytes > 0")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be > 0")
        if self.attention_backend not in ("auto", "torch", "flashinfer"):
            raise ValueError(
                f"attention_backend must be auto|torch|flashinfer, got {self.attention_backend!r}"
            )
        if self.num_threads < 0 or self.max_model_len < 0:
            raise ValueError("num_threads and max_model_len must be >= 0")
        if not 0.0 <= self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.gpu_memory_utilization > 0 and not self.device.startswith("cuda"):
            raise ValueError("gpu_memory_utilization needs a CUDA device (use kv_cache_mib)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]
