"""Load an HF model directory: config.json + *.safetensors (single or sharded) + tokenizer.json.

Supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM (dense). Every failure is a
ModelLoadError that names the file or config field, never a bare traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from shared.engine.config import ModelConfig
from shared.errors import ModelLoadError
from shared.tokenizer.hf_dir import read_json, special_ids_from_dir

# architectures[0] -> (model_type, our architecture name)
_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "llama"),
    "Qwen2ForCausalLM": ("qwen2", "qwen2"),
    "Qwen3ForCausalLM": ("qwen3", "qwen3"),
}
_SUPPORTED_ROPE_TYPES = ("default", "llama3")


def _rope(cfg: dict[str, Any], where: Path) -> tuple[float, tuple[tuple[str, Any], ...]]:
    """rope_theta and rope_scaling, from either the v4 layout (rope_theta, rope_scaling) or the
    transformers v5 layout (rope_parameters)."""
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling")
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if not scaling:
        return float(theta), ()
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{where}: rope_scaling type {rope_type!r} is not supported "
            f"(supported: {', '.join(_SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return float(theta), ()
    items = {k: v for k, v in scaling.items() if k != "type"}
    items["rope_type"] = rope_type
    return float(theta), tuple(sorted(items.items()))


def read_hf_config(model_dir: Path) -> ModelConfig:
    """ModelConfig from ``model_dir``/config.json (+ generation_config.json for eos ids)."""
    path = model_dir / "config.json"
    cfg = read_json(path, required=True)
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    if not archs or archs[0] not in _ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: architectures={archs!r} is not supported "
            f"(supported: {', '.join(_ARCHITECTURES)})"
        )
    expected_type, architecture = _ARCHITECTURES[archs[0]]
    if model_type != expected_type:
        raise ModelLoadError(
            f"{path}: model_type={model_type!r} does not match architectures={archs!r} "
            f"(expected {expected_type!r})"
        )
    for flag in ("mlp_bias", "use_sliding_window"):
        if cfg.get(flag):
            raise ModelLoadError(f"{path}: {flag}=true is not supported")
    if architecture != "qwen2" and cfg.get("attention_bias"):
        raise ModelLoadError(f"{path}: attention_bias=true is not supported for {architecture}")
    try:
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        rope_theta, rope_scaling = _rope(cfg, path)
        bos_id, eos_ids = special_ids_from_dir(model_dir)
        return ModelConfig(
            architecture=architecture,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=architecture == "qwen2",
            qk_norm=architecture == "qwen3",
            rope_scaling=rope_scaling,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
        )
    except KeyError as exc:
        raise ModelLoadError(f"{path}: missing field {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: invalid value: {exc}") from exc


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the engine needs, in HF naming, with its HF shape ([out, in])."""
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    q = config.num_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if config.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (config.head_dim,)
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def _shard_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> file holding it (from the index for sharded checkpoints)."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index_path}: no weight_map")
        return {name: model_dir / str(file) for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors file")
    located: dict[str, Path] = {}
    for file in files:
        for name in _open(file).keys():  # noqa: SIM118 (safe_open is not a dict)
            located.setdefault(name, file)
    return located


def _open(file: Path) -> Any:
    if not file.is_file():
        raise ModelLoadError(f"{file}: file not found")
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{file}: corrupt or unreadable safetensors file: {exc}") from exc


def load_hf_weights(
    model_dir: Path, config: ModelConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Read every expected tensor from the safetensors files, check its shape, cast to ``dtype``.

    Extra tensors (rotary inv_freq, a tied lm_head) are ignored. Raises ModelLoadError.
    """
    located = _shard_files(model_dir)
    shapes = expected_shapes(config)
    by_file: dict[Path, list[str]] = {}
    for name in shapes:
        if name not in located:
            raise ModelLoadError(f"{model_dir}: tensor {name!r} missing from the safetensors files")
        by_file.setdefault(located[name], []).append(name)
    weights: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        handle = _open(file)
        for name in names:
            try:
                tensor = handle.get_tensor(name)
            except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
                raise ModelLoadError(f"{file}: cannot read tensor {name!r}: {exc}") from exc
            if tuple(tensor.shape) != shapes[name]:
                raise ModelLoadError(
                    f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"config.json implies {shapes[name]}"
                )
            weights[name] = tensor.to(dtype).contiguous()
    return weights


def load_hf_dir(
    path: str | Path, dtype: torch.dtype
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, HF-named weights in ``dtype``) of the model directory ``path``."""
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: model directory not found")
    config = read_hf_config(model_dir)
    return config, load_hf_weights(model_dir, config, dtype)
