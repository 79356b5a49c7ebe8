"""Load a GGUF file (llama / qwen2 / qwen3 dense) into HF-named float tensors.

Matches ``transformers.AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` bit for bit:
tensors are dequantized with ``gguf.quants.dequantize`` (float32) and, for the llama
architecture, the Q/K row permutation that llama.cpp's convert_hf_to_gguf applies (to turn HF's
half-split rotary layout into interleaved pairs) is undone exactly as transformers'
``LlamaTensorProcessor._reverse_permute_weights`` does. qwen2/qwen3 are converted unpermuted.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.engine.config import ModelConfig
from shared.engine.hf_loader import expected_shapes
from shared.errors import ModelLoadError
from shared.tokenizer.gguf_metadata import read_gguf_metadata

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_SUPPORTED = ("llama", "qwen2", "qwen3")


def hf_name(gguf_name: str) -> str | None:
    """HF parameter name of a GGUF tensor name, or None if it has no HF counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.match(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def reverse_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's ``permute`` of q_proj/k_proj rows (``num_heads`` = heads of
    that projection: attention heads for q, kv heads for k). Same ops as transformers."""
    dim = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def _require(metadata: dict[str, Any], key: str, where: Path) -> Any:
    if key not in metadata:
        raise ModelLoadError(f"{where}: GGUF metadata has no {key!r}")
    return metadata[key]


def gguf_model_config(metadata: dict[str, Any], has_output: bool, where: Path) -> ModelConfig:
    """ModelConfig from GGUF metadata (``{arch}.*`` keys, tokenizer.ggml.* special ids)."""
    arch = _require(metadata, "general.architecture", where)
    if arch not in _SUPPORTED:
        raise ModelLoadError(
            f"{where}: general.architecture={arch!r} is not supported (supported: {', '.join(_SUPPORTED)})"
        )
    hidden = int(_require(metadata, f"{arch}.embedding_length", where))
    num_heads = int(_require(metadata, f"{arch}.attention.head_count", where))
    head_dim = metadata.get(f"{arch}.attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = metadata.get("llama.rope.dimension_count")
    vocab_size = metadata.get(f"{arch}.vocab_size") or len(
        metadata.get("tokenizer.ggml.tokens") or []
    )
    if metadata.get(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise ModelLoadError(
            f"{where}: {arch}.rope.scaling.type={metadata[f'{arch}.rope.scaling.type']!r} is not "
            "supported for GGUF; load the HF directory instead"
        )
    eos_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        if metadata.get(key) is not None and int(metadata[key]) not in eos_ids:
            eos_ids.append(int(metadata[key]))
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=int(vocab_size),
            hidden_size=hidden,
            intermediate_size=int(_require(metadata, f"{arch}.feed_forward_length", where)),
            num_layers=int(_require(metadata, f"{arch}.block_count", where)),
            num_heads=num_heads,
            num_kv_heads=int(metadata.get(f"{arch}.attention.head_count_kv") or num_heads),
            head_dim=int(head_dim or hidden // num_heads),
            max_position_embeddings=int(_require(metadata, f"{arch}.context_length", where)),
            rms_norm_eps=float(
                _require(metadata, f"{arch}.attention.layer_norm_rms_epsilon", where)
            ),
            rope_theta=float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
            tie_word_embeddings=not has_output,
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(eos_ids),
        )
    except ValueError as exc:
        raise ModelLoadError(f"{where}: invalid GGUF metadata: {exc}") from exc


def load_gguf(
    path: str | Path, dtype: torch.dtype, metadata: dict[str, Any] | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, HF-named weights in ``dtype``) of the GGUF file ``path``.

    ``metadata`` (from read_gguf_metadata) may be passed to avoid reading it twice.
    Raises ModelLoadError on a missing/corrupt file, unsupported architecture, unknown or
    missing tensor, or a shape that disagrees with the metadata.
    """
    from gguf import GGUFReader
    from gguf.quants import dequantize

    gguf_path = Path(path)
    if not gguf_path.is_file():
        raise ModelLoadError(f"{gguf_path}: GGUF file not found")
    if metadata is None:
        metadata = read_gguf_metadata(gguf_path)
    try:
        reader = GGUFReader(gguf_path)
    except (OSError, ValueError, IndexError) as exc:
        raise ModelLoadError(f"{gguf_path}: corrupt GGUF file: {exc}") from exc
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    config = gguf_model_config(metadata, has_output, gguf_path)
    shapes = expected_shapes(config)
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            raise ModelLoadError(f"{gguf_path}: unsupported GGUF tensor {tensor.name!r}")
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            raise ModelLoadError(
                f"{gguf_path}: cannot dequantize {tensor.name!r} ({tensor.tensor_type.name}): {exc}"
            ) from exc
        if config.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            array = reverse_permute(array, heads)
        if name not in shapes or tuple(array.shape) != shapes[name]:
            raise ModelLoadError(
                f"{gguf_path}: tensor {tensor.name!r} -> {name!r} has shape {tuple(array.shape)}, "
                f"metadata implies {shapes.get(name)}"
            )
        weights[name] = torch.from_numpy(np.array(array, dtype=np.float32, copy=True)).to(dtype)
    missing = sorted(set(shapes) - set(weights))
    if missing:
        raise ModelLoadError(
            f"{gguf_path}: GGUF lacks tensors {missing[:4]} ({len(missing)} missing)"
        )
    return config, weights
