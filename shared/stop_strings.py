"""Stop strings on streamed text (OpenAI semantics: the stop string itself is not returned).

``StopMatcher`` holds back the tail of the text that could still become a stop string, so a
streaming client never sees text that a later token turns into a stop.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feed text deltas; get back the text that is safe to emit. Mutates its own buffer only."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._buffer = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add ``delta``; return the newly emittable text. After a stop, returns ''."""
        if self.stopped:
            return ""
        if not self._stops:
            return delta
        self._buffer += delta
        cut = min((i for i in (self._buffer.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self._buffer = self._buffer[:cut], ""
            return out
        keep = min(self._hold, len(self._buffer))
        out = self._buffer[: len(self._buffer) - keep]
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return out

    def flush(self) -> str:
        """End of stream: release what was held back."""
        out, self._buffer = ("" if self.stopped else self._buffer), ""
        return out


def apply_stop_strings(
    tokenizer: object, token_ids: Sequence[int], stops: Sequence[str]
) -> tuple[list[int], str, bool]:
    """Cut a finished generation at the first stop string.

    Returns (token ids up to and including the token that completed the stop, text without
    the stop string, whether a stop string matched).
    """
    decode = tokenizer.decode  # type: ignore[attr-defined]
    if not stops:
        return list(token_ids), decode(list(token_ids)), False
    matcher = StopMatcher(stops)
    text = ""
    prev = ""
    for i in range(len(token_ids)):
        full = decode(list(token_ids[: i + 1]))
        if full.endswith("\ufffd"):
            continue  # an incomplete UTF-8 sequence: wait for the next token
        text += matcher.feed(full[len(prev) :])
        prev = full
        if matcher.stopped:
            return list(token_ids[: i + 1]), text, True
    return list(token_ids), text + matcher.flush(), False
