"""Streaming detokenization: turn generated token ids into text pieces as they arrive.

Approach of vLLM / HF TextStreamer: keep two offsets into the generated ids. ``prefix_offset``
marks a few tokens of already-emitted context, ``read_offset`` the first id not yet emitted. Each
step decodes ``ids[prefix_offset:read_offset]`` and ``ids[prefix_offset:]``; the difference is
the new text. Decoding with some left context makes tokenizers that strip a leading space
(Metaspace) or merge bytes across tokens give the same text as one full decode. If the new text
ends in U+FFFD the last token ended inside a multi-byte UTF-8 character: emit nothing and wait for
the bytes that complete it.
"""

from __future__ import annotations

from typing import Protocol

_REPLACEMENT = "\ufffd"
# Context tokens decoded in front of the new ones; enough for any merge/strip effect we know of.
_CONTEXT_TOKENS = 5


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Feed ids one at a time with ``push``; get back only newly completed text.

    Not thread-safe (one instance per sequence). ``prompt_ids`` (optional) seed the left context
    so that the first generated token decodes as it would after the prompt; they are never
    emitted. The concatenation of every ``push`` result plus ``flush()`` equals
    ``decode(generated_ids)`` for byte-level tokenizers.
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_ids or [])[-_CONTEXT_TOKENS:]
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_generated = 0

    @property
    def num_generated(self) -> int:
        """Ids pushed so far (prompt context not counted)."""
        return self._num_generated

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Append one id; return the text it completes ('' while a character is incomplete)."""
        self._ids.append(int(token_id))
        self._num_generated += 1
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""
        new_text = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._trim()
        return new_text

    def push_many(self, token_ids: list[int]) -> str:
        """``push`` each id in turn; return the concatenated new text."""
        return "".join(self.push(token_id) for token_id in token_ids)

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character at the end of the
        stream decodes to U+FFFD here, as in a full decode) and mark it emitted."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def _trim(self) -> None:
        """Drop ids left of ``prefix_offset`` so memory stays O(context), not O(sequence)."""
        if self._prefix_offset > 4 * _CONTEXT_TOKENS:
            cut = self._prefix_offset
            del self._ids[:cut]
            self._prefix_offset -= cut
            self._read_offset -= cut
