"""Tokenizer: a ``tokenizers.Tokenizer`` plus the chat template and special ids of one model.

Must stay importable without torch or shared.engine: the router imports it at start-up.
Built from files by ``tokenizer_from_dir`` (hf_dir.py) or ``tokenizer_from_gguf``
(gguf_tokenizer.py), which import this module; by model name or path: models.py.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Any

import tokenizers

from shared.errors import InvalidRequestError
from shared.tokenizer.chat_template import ChatTemplate


class Tokenizer:
    """Encode/decode text and render chat prompts for one model. Immutable after construction.

    ``eos_token_ids`` are every id that ends generation (the generation config's list, so chat
    models stop on their end-of-turn token). Construction is cheap apart from what the backend
    costs; nothing is cached at module level.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        special_tokens: dict[str, str | None] | None = None,
        source: str = "",
    ) -> None:
        self._backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.source = source
        tokens = dict(special_tokens or {})
        if "bos_token" not in tokens:
            tokens["bos_token"] = self._id_to_token(bos_token_id)
        if "eos_token" not in tokens:
            first_eos = self._eos_token_ids[0] if self._eos_token_ids else None
            tokens["eos_token"] = self._id_to_token(first_eos)
        self._special_tokens = tokens
        self._chat_template = ChatTemplate(chat_template, tokens) if chat_template else None
        self._digest: str | None = None
        self._max_token_chars: int | None = None

    # ---- properties ---------------------------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def max_token_chars(self) -> int:
        """The most text characters one token can stand for: the longest vocabulary entry
        (added tokens included). A byte-level entry is spelled one character per byte, and a
        text character is at least one byte, so this bounds characters per token from above
        (up to what a normalizer removes). The router's prompt-size check (before any
        tokenizing) rests on it. Computed once (one pass over the vocabulary)."""
        if self._max_token_chars is None:
            vocab = self._backend.get_vocab(with_added_tokens=True)
            self._max_token_chars = max(1, max(map(len, vocab), default=1))
        return self._max_token_chars

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template.source if self._chat_template else None

    @property
    def special_tokens(self) -> dict[str, str | None]:
        """``bos_token``, ``eos_token``, ... as strings (what the chat template sees)."""
        return dict(self._special_tokens)

    # ---- operations ---------------------------------------------------------------------------

    def encode(
        self, text: str, add_special_tokens: bool = False, *, release_gil: bool = False
    ) -> list[int]:
        """Token ids of ``text``. Special-token strings in the text map to their ids (as in HF).
        ``release_gil``: encode through the backend's batch call, which lets go of the GIL
        while it works (its single-text call holds it throughout), so other threads (the
        router's event loop) run meanwhile; same ids. Raises InvalidRequestError for text
        that is not valid Unicode: a lone UTF-16 surrogate, which a JSON body can carry as
        an escape ("\\ud800")."""
        try:
            if release_gil:
                batch = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
                return list(batch[0].ids)
            return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)
        except TypeError:  # the backend takes only encodable str ("must be str")
            at = next((i for i, ch in enumerate(text) if "\ud800" <= ch <= "\udfff"), None)
            if at is None:
                raise
            raise InvalidRequestError(
                f"the text is not valid Unicode: a lone surrogate at character {at}"
            ) from None

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Incomplete UTF-8 decodes to U+FFFD (use IncrementalDetokenizer)."""
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        token_id = self._backend.token_to_id(token)
        return None if token_id is None else int(token_id)

    def _id_to_token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._backend.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Prompt text for ``messages`` (same string as HF's apply_chat_template, tokenize=False).

        Raises InvalidRequestError if the model has no chat template or the template rejects them.
        """
        if self._chat_template is None:
            raise InvalidRequestError("this model has no chat template; use /v1/completions")
        return self._chat_template.render(messages, add_generation_prompt=add_generation_prompt)

    def digest(self) -> str:
        """Stable hash of vocabulary, merges, added tokens, pre-tokenization, chat template and
        special ids (part of the KV fingerprint: two workers agree iff token ids mean the same)."""
        if self._digest is None:
            spec = json.loads(self._backend.to_str())
            model = spec.get("model") or {}
            payload = {
                "model_type": model.get("type"),
                "vocab": sorted((model.get("vocab") or {}).items(), key=lambda kv: kv[1])
                if isinstance(model.get("vocab"), dict)
                else model.get("vocab"),
                "merges": [
                    m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []
                ],
                "added": [
                    (t.get("id"), t.get("content"), t.get("special"))
                    for t in spec.get("added_tokens") or []
                ],
                "normalizer": spec.get("normalizer"),
                "pre_tokenizer": spec.get("pre_tokenizer"),
                "chat_template": self.chat_template,
                "bos": self._bos_token_id,
                "eos": list(self._eos_token_ids),
            }
            blob = json.dumps(payload, sort_keys=True, ensure_ascii=False).encode()
            self._digest = hashlib.sha256(blob).hexdigest()[:16]
        return self._digest

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self._bos_token_id}, "
            f"eos={self._eos_token_ids}, source={self.source!r})"
        )
