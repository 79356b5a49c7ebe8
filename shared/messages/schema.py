"""The message base class and the message errors.

Every message is a frozen, keyword-only dataclass deriving from :class:`Message`. Its field
type hints are its schema (see shared.messages.wire_plan for the rules): supported hints
are ``int``, ``float``, ``str``, ``bool``, ``bytes``, ``None``, ``X | None``,
``Literal[...]``, ``tuple[X, ...]``, ``dict[str, X]`` and nested message dataclasses.

Field metadata: ``wire`` renames a field on the wire (``from`` is a Python keyword);
``max_len`` bounds a str/tuple/dict length (default :data:`DEFAULT_MAX_STR_CHARS` for
strings, :data:`DEFAULT_MAX_ITEMS` for containers) so that every message has a size bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shared.errors import InvalidRequestError

DEFAULT_MAX_STR_CHARS = 256
DEFAULT_MAX_ITEMS = 4096
INT_MIN = -(2**63)
INT_MAX = 2**64 - 1  # u64 ids (transfer_id) must fit; msgpack carries up to u64.


class MessageError(InvalidRequestError):
    """A payload is not a valid message of the expected type and version.

    Raised for undecodable bytes, a wrong type tag or schema version, unknown or missing
    fields, wrong field types and out-of-range values. Carries no payload bytes.
    """

    code = "invalid_message"


class MessageTooLargeError(MessageError):
    """An encoded message would exceed the wire size limit (raised at encode time)."""

    code = "message_too_large"


@dataclass(frozen=True, kw_only=True)
class Message:
    """Base of every wire message.

    Subclasses set ``TYPE_TAG`` (unique, snake_case), ``SCHEMA_VERSION`` (bumped on any
    incompatible change) and ``JSON_ACCEPTED`` (control messages an operator may type as
    JSON). ``check()`` may add semantic rules; it raises :class:`MessageError`.
    """

    TYPE_TAG: ClassVar[str] = ""
    SCHEMA_VERSION: ClassVar[int] = 1
    JSON_ACCEPTED: ClassVar[bool] = False
    # Nested-only: travel as an array of field values (field order) instead of a map —
    # for small items sent in bulk (TokenItem). Top-level messages are always maps.
    WIRE_ARRAY: ClassVar[bool] = False

    def check(self) -> None:
        """Semantic validation beyond types; override and raise MessageError. No mutation."""


def truncate_text(text: str, max_chars: int) -> str:
    """``text`` cut to at most ``max_chars`` characters (with a marker when cut)."""
    if len(text) <= max_chars:
        return text
    return text[: max(0, max_chars - 3)] + "..."
