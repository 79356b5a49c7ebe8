"""OpenAI ``logprobs`` objects from the workers' TokenLogprobs (formats as vLLM serves).

Completions (``logprobs: k``): ``{tokens, token_logprobs, top_logprobs, text_offset}``,
``top_logprobs`` a ``{token text: logprob}`` dict per position holding the k most likely
and the chosen token; with ``echo`` the prompt comes first and its first token has
``None`` entries (nothing precedes it). Chat (``logprobs: true, top_logprobs: k``):
``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``.
Token text is the token decoded alone. Values are raw-model logprobs (see
shared/engine/logprobs.py); -inf is sent as -9999.0, as vLLM does (JSON has no -inf).
"""

from __future__ import annotations

import math
from typing import Any

from shared.messages import TokenLogprob
from shared.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) and logprob > MIN_LOGPROB else MIN_LOGPROB


class CompletionLogprobs:
    """Accumulates one completion choice's ``logprobs`` object. Mutates itself only."""

    def __init__(self, tokenizer: Tokenizer, num_top: int) -> None:
        self._tok = tokenizer
        self._num_top = num_top
        self._text_len = 0
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, token_id: int, lp: TokenLogprob | None) -> None:
        """Append one token (``lp`` None: the first prompt token under echo)."""
        text = self._tok.decode([token_id], skip_special_tokens=False)
        self.tokens.append(text)
        self.text_offset.append(self._text_len)
        self._text_len += len(text)
        if lp is None:
            self.token_logprobs.append(None)
            self.top_logprobs.append(None)
            return
        self.token_logprobs.append(_value(lp.logprob))
        top: dict[str, float] = {}
        for tid, value in zip(lp.top_ids[: self._num_top], lp.top_logprobs, strict=False):
            top.setdefault(self._tok.decode([tid], skip_special_tokens=False), _value(value))
        top.setdefault(text, _value(lp.logprob))
        self.top_logprobs.append(top)

    def take(self) -> dict[str, Any]:
        """The object so far, and start over (a stream sends each piece once)."""
        out = {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out


class ChatLogprobs:
    """Accumulates one chat choice's ``logprobs.content`` list. Mutates itself only."""

    def __init__(self, tokenizer: Tokenizer, num_top: int) -> None:
        self._tok = tokenizer
        self._num_top = num_top
        self.content: list[dict[str, Any]] = []

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._tok.decode([token_id], skip_special_tokens=False)
        return {
            "token": text,
            "logprob": _value(logprob),
            "bytes": list(text.encode("utf-8", errors="replace")),
        }

    def add(self, token_id: int, lp: TokenLogprob | None) -> None:
        if lp is None:
            return
        entry = self._entry(token_id, lp.logprob)
        entry["top_logprobs"] = [
            self._entry(tid, value)
            for tid, value in zip(lp.top_ids[: self._num_top], lp.top_logprobs, strict=False)
        ]
        self.content.append(entry)

    def take(self) -> dict[str, Any]:
        out = {"content": self.content}
        self.content = []
        return out


def make_logprobs(
    tokenizer: Tokenizer, kind: str, num_top: int | None
) -> CompletionLogprobs | ChatLogprobs | None:
    """The accumulator for a request (None when it did not ask for logprobs)."""
    if num_top is None:
        return None
    if kind == "chat":
        return ChatLogprobs(tokenizer, num_top)
    return CompletionLogprobs(tokenizer, num_top)
