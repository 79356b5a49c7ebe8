"""Tokenizer from an HF model directory: tokenizer.json + tokenizer_config.json (+ chat_template.jinja,
generation_config.json, config.json for the special ids)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from shared.errors import ModelLoadError
from shared.tokenizer.tokenizer import Tokenizer


def read_json(path: Path, required: bool = False) -> dict[str, Any]:
    """Parse a JSON object file. Missing optional file -> {}. Raises ModelLoadError naming ``path``."""
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path}: file not found")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot parse JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]


def special_ids_from_dir(
    model_dir: Path, backend: BackendTokenizer | None = None
) -> tuple[int | None, tuple[int, ...]]:
    """``(bos_token_id, eos_token_ids)`` as HF generation sees them.

    eos: generation_config.json's ``eos_token_id`` (int or list), else config.json's, else the
    tokenizer_config ``eos_token``. bos likewise with the order config files -> tokenizer_config.
    """
    generation = read_json(model_dir / "generation_config.json")
    config = read_json(model_dir / "config.json")
    tok_config = read_json(model_dir / "tokenizer_config.json")

    eos_ids = _as_id_list(generation.get("eos_token_id"))
    if not eos_ids:
        eos_ids = _as_id_list(config.get("eos_token_id"))
    if not eos_ids and backend is not None:
        eos_text = _token_text(tok_config.get("eos_token"))
        eos_id = backend.token_to_id(eos_text) if eos_text else None
        eos_ids = [] if eos_id is None else [int(eos_id)]

    bos_values = _as_id_list(generation.get("bos_token_id")) or _as_id_list(
        config.get("bos_token_id")
    )
    bos_id: int | None = bos_values[0] if bos_values else None
    if bos_id is None and backend is not None:
        bos_text = _token_text(tok_config.get("bos_token"))
        found = backend.token_to_id(bos_text) if bos_text else None
        bos_id = None if found is None else int(found)
    return bos_id, tuple(dict.fromkeys(eos_ids))


def _chat_template(model_dir: Path, tok_config: dict[str, Any]) -> str | None:
    """chat_template.jinja (transformers >= 4.43 saves it there) wins over tokenizer_config."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{jinja_file}: cannot read: {exc}") from exc
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def tokenizer_from_dir(path: str | Path) -> Tokenizer:
    """Load the Tokenizer of the HF model directory ``path``. Raises ModelLoadError."""
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: not a directory")
    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelLoadError(
            f"{tokenizer_file}: file not found (only fast tokenizers are supported)"
        )
    try:
        backend = BackendTokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise ModelLoadError(f"{tokenizer_file}: cannot load tokenizer: {exc}") from exc
    tok_config = read_json(model_dir / "tokenizer_config.json")
    bos_id, eos_ids = special_ids_from_dir(model_dir, backend)
    special_tokens = {
        name: _token_text(tok_config.get(name))
        for name in ("bos_token", "eos_token", "unk_token", "pad_token")
    }
    return Tokenizer(
        backend,
        chat_template=_chat_template(model_dir, tok_config),
        bos_token_id=bos_id,
        eos_token_ids=eos_ids,
        special_tokens=special_tokens,
        source=str(model_dir),
    )
