"""Rebuild a byte-level BPE tokenizer from GGUF metadata (``tokenizer.ggml.*``).

Matches transformers' GGUF tokenizer conversion (integrations/gguf/gguf_tokenizer_mapping.py):
GPT-2 style BPE over the byte alphabet, CONTROL tokens added as special, USER_DEFINED as plain
added tokens, ByteLevel decoder. The pre-tokenizer follows ``tokenizer.ggml.pre`` the way
llama.cpp does: "smollm" splits every digit first (SmolLM2's own tokenizer.json does too).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from shared.errors import ModelLoadError
from shared.tokenizer.gguf_metadata import read_gguf_metadata
from shared.tokenizer.tokenizer import Tokenizer

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_REGEX_BY_PRE = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the byte-level alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {byte: chr(code) for byte, code in zip(printable, codes, strict=True)}


def _pre_tokenizer(pre_type: str | None) -> pre_tokenizers.PreTokenizer:
    if pre_type in (None, "default", "gpt2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre_type == "smollm":
        # llama.cpp: "\p{N}" split, then the GPT-2 regex; SmolLM2's tokenizer.json: Digits(individual) + ByteLevel.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre_type in _SPLIT_REGEX_BY_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_REGEX_BY_PRE[pre_type]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ModelLoadError(
        f"GGUF tokenizer.ggml.pre={pre_type!r} is not supported "
        f"(supported: default, gpt2, smollm, {', '.join(sorted(_SPLIT_REGEX_BY_PRE))})"
    )


def _optional_id(metadata: dict[str, Any], key: str) -> int | None:
    value = metadata.get(key)
    return None if value is None else int(value)


def tokenizer_from_gguf_metadata(metadata: dict[str, Any], source: str = "") -> Tokenizer:
    """Build the Tokenizer described by already-read GGUF ``metadata``. Raises ModelLoadError."""
    where = source or "GGUF"
    model_type = metadata.get("tokenizer.ggml.model")
    if model_type != "gpt2":
        raise ModelLoadError(
            f"{where}: tokenizer.ggml.model={model_type!r} is not supported (only byte-level BPE 'gpt2')"
        )
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
    merges_raw: list[str] = metadata.get("tokenizer.ggml.merges") or []
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or []
    if not tokens:
        raise ModelLoadError(f"{where}: GGUF has no tokenizer.ggml.tokens")

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): index
        for index, token in enumerate(tokens)
    }
    merges: list[tuple[str, str]] = []
    for merge in merges_raw:
        left, _, right = merge.partition(" ")
        merges.append((left, right))
    backend = BackendTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()

    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types, strict=False)
        if kind == _TOKEN_TYPE_CONTROL and set(token) <= alphabet
    ]
    if control:
        backend.add_special_tokens(control)
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, token_types, strict=False)
        if kind == _TOKEN_TYPE_USER_DEFINED and token in vocab
    ]
    if user_defined:
        backend.add_tokens(user_defined)

    bos_id = _optional_id(metadata, "tokenizer.ggml.bos_token_id")
    eos_ids: list[int] = []
    # eos first; llama.cpp also ends generation on the end-of-turn token when the file names one.
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        token_id = _optional_id(metadata, key)
        if token_id is not None and token_id not in eos_ids:
            eos_ids.append(token_id)
    if metadata.get("tokenizer.ggml.add_bos_token") and bos_id is not None:
        bos = tokens[bos_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )

    def token_at(key: str) -> str | None:
        token_id = _optional_id(metadata, key)
        return tokens[token_id] if token_id is not None and token_id < len(tokens) else None

    special_tokens = {
        "bos_token": token_at("tokenizer.ggml.bos_token_id"),
        "eos_token": token_at("tokenizer.ggml.eos_token_id"),
        "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_at("tokenizer.ggml.padding_token_id"),
    }
    return Tokenizer(
        backend,
        chat_template=metadata.get("tokenizer.chat_template"),
        bos_token_id=bos_id,
        eos_token_ids=tuple(eos_ids),
        special_tokens=special_tokens,
        source=source,
    )


def tokenizer_from_gguf(path: str | Path) -> Tokenizer:
    """Read ``path``'s metadata and build its Tokenizer. Raises ModelLoadError."""
    return tokenizer_from_gguf_metadata(read_gguf_metadata(path), source=str(path))
