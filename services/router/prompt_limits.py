"""How much text and how many body bytes a request may bring, from the context limit alone.

A prompt longer than ``max_model_len`` tokens is refused anyway, but only after it is
tokenized, and tokenizing costs time in its length: a 20 MB prompt held the router's parse
thread (and the GIL) for 16 s, long enough for nats-server to drop the router as a slow
consumer. No text of more than ``max_model_len × max_token_chars`` characters fits in
``max_model_len`` tokens, so the router refuses longer text before tokenizing it, and caps
the request body at what such text can take in JSON. Both figures carry a margin
(``PROMPT_CHARS_MARGIN``) for what the bound does not see: a normalizer that shrinks text,
an unknown-token run that maps to one id.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.router.errors import BadRequest

# The multiple of the exact bound that is still let through to the tokenizer.
PROMPT_CHARS_MARGIN = 4
# The most bytes one text character takes in a JSON body: "\u00e9" (a BMP character
# escaped). A character outside the BMP takes 12 ("\ud83d\ude00"), but such characters are
# at most a few per token, far under ``max_token_chars`` (a long run of plain ASCII).
JSON_BYTES_PER_CHAR = 6
# Room for everything in a body besides the prompt text (fields, stop strings, JSON framing).
BODY_OVERHEAD_BYTES = 1024 * 1024
# The ceiling whatever the context: also the body limit before any worker has registered.
MAX_BODY_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class PromptLimits:
    """The text and body bounds for a context of ``max_model_len`` tokens and a tokenizer
    whose longest token is ``max_token_chars`` characters (Tokenizer.max_token_chars)."""

    max_model_len: int
    max_token_chars: int

    def __post_init__(self) -> None:
        if self.max_model_len < 1 or self.max_token_chars < 1:
            raise ValueError(
                f"max_model_len and max_token_chars must be >= 1, got "
                f"{self.max_model_len} and {self.max_token_chars}"
            )

    @property
    def prompt_chars(self) -> int:
        """The most characters of prompt text that are tokenized. Pure."""
        return self.max_model_len * self.max_token_chars * PROMPT_CHARS_MARGIN

    @property
    def body_bytes(self) -> int:
        """The most bytes a request body may have: prompt text at its limit, every character
        escaped, plus the other fields; never above MAX_BODY_BYTES. Pure."""
        return min(MAX_BODY_BYTES, self.prompt_chars * JSON_BYTES_PER_CHAR + BODY_OVERHEAD_BYTES)

    def check_chars(self, chars: int, param: str) -> None:
        """Refuse ``chars`` characters of prompt text (the body's ``param``) before it is
        tokenized when no tokenizing could make it fit. Raises BadRequest with code
        ``context_length_exceeded``, as a prompt of too many tokens does."""
        if chars > self.prompt_chars:
            raise BadRequest(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {chars} characters, more than that many tokens can hold (the "
                f"limit is {self.prompt_chars} characters)",
                param=param,
                code="context_length_exceeded",
            )
