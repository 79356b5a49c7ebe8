"""Strict, type-hint-driven validation of wire messages.

Every message is a frozen, keyword-only dataclass deriving from :class:`Message`. Its field
type hints are the schema: :func:`from_wire` turns a decoded msgpack/JSON mapping into the
dataclass, accepting nothing that the hints do not describe (no coercion of ``"1"`` to 1,
no bool-for-int, no unknown or missing fields, no NaN), and :func:`to_wire` does the
reverse. Supported hints: ``int``, ``float``, ``str``, ``bool``, ``bytes``, ``None``,
``X | None``, ``Literal[...]``, ``tuple[X, ...]``, ``dict[str, X]`` and nested message
dataclasses.

Field metadata: ``wire`` renames a field on the wire (``from`` is a Python keyword);
``max_len`` bounds a str/tuple/dict length (default :data:`DEFAULT_MAX_STR_CHARS` for
strings, :data:`DEFAULT_MAX_ITEMS` for containers) so that every message has a size bound.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

from shared.errors import InvalidRequestError

DEFAULT_MAX_STR_CHARS = 256
DEFAULT_MAX_ITEMS = 4096
INT_MIN = -(2**63)
INT_MAX = 2**64 - 1  # u64 ids (transfer_id) must fit; msgpack carries up to u64.

M = TypeVar("M", bound="Message")


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

    def check(self) -> None:
        """Semantic validation beyond types; override and raise MessageError. No mutation."""


@dataclass(frozen=True)
class _FieldSpec:
    name: str
    wire_name: str
    hint: Any
    required: bool
    max_len: int | None


@functools.cache
def field_specs(cls: type[Message]) -> tuple[_FieldSpec, ...]:
    """The resolved field specs of a message class (cached per class; pure)."""
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        specs.append(
            _FieldSpec(
                name=f.name,
                wire_name=f.metadata.get("wire", f.name),
                hint=hints[f.name],
                required=required,
                max_len=f.metadata.get("max_len"),
            )
        )
    return tuple(specs)


def _fail(path: str, why: str) -> typing.NoReturn:
    raise MessageError(f"field {path}: {why}")


def _check_str(value: Any, path: str, max_len: int | None) -> str:
    if type(value) is not str:
        _fail(path, f"expected string, got {type(value).__name__}")
    limit = DEFAULT_MAX_STR_CHARS if max_len is None else max_len
    if len(value) > limit:
        _fail(path, f"string longer than {limit} characters")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            _fail(path, "string is not valid unicode")
    return value


def _convert(value: Any, hint: Any, path: str, json_mode: bool, max_len: int | None) -> Any:
    """Validate ``value`` against ``hint`` and return the Python value. Raises MessageError."""
    if hint is int:
        if type(value) is not int:
            _fail(path, f"expected integer, got {type(value).__name__}")
        if not INT_MIN <= value <= INT_MAX:
            _fail(path, "integer out of range")
        return value
    if hint is float:
        if type(value) is int:
            if not INT_MIN <= value <= INT_MAX:
                _fail(path, "number out of range")
            return float(value)
        if type(value) is not float:
            _fail(path, f"expected number, got {type(value).__name__}")
        if math.isnan(value):
            _fail(path, "NaN is not allowed")
        return value
    if hint is str:
        return _check_str(value, path, max_len)
    if hint is bool:
        if type(value) is not bool:
            _fail(path, f"expected boolean, got {type(value).__name__}")
        return value
    if hint is bytes:
        if json_mode and type(value) is str:
            try:
                return base64.b64decode(value.encode("ascii"), validate=True)
            except (binascii.Error, UnicodeEncodeError, ValueError):
                _fail(path, "expected base64 string")
        if type(value) is not bytes:
            _fail(path, f"expected bytes, got {type(value).__name__}")
        return value
    if hint is type(None):
        if value is not None:
            _fail(path, "expected null")
        return None
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is types.UnionType or origin is typing.Union:
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) != 1:
            raise TypeError(f"unsupported union hint {hint!r} at {path}")
        return _convert(value, non_none[0], path, json_mode, max_len)
    if origin is Literal:
        for allowed in args:
            if type(value) is type(allowed) and value == allowed:
                return value
        _fail(path, f"expected one of {list(args)!r}")
    if origin is tuple:
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"only tuple[X, ...] is supported, got {hint!r} at {path}")
        if type(value) is not list and type(value) is not tuple:
            _fail(path, f"expected array, got {type(value).__name__}")
        limit = DEFAULT_MAX_ITEMS if max_len is None else max_len
        if len(value) > limit:
            _fail(path, f"more than {limit} items")
        item_hint = args[0]
        if item_hint is int:  # fast path: token id lists are the big arrays
            if not all(type(v) is int for v in value):
                _fail(path, "expected array of integers")
            if value and not (min(value) >= INT_MIN and max(value) <= INT_MAX):
                _fail(path, "integer out of range")
            return tuple(value)
        return tuple(
            _convert(v, item_hint, f"{path}[{i}]", json_mode, None) for i, v in enumerate(value)
        )
    if origin is dict:
        if type(value) is not dict:
            _fail(path, f"expected object, got {type(value).__name__}")
        limit = DEFAULT_MAX_ITEMS if max_len is None else max_len
        if len(value) > limit:
            _fail(path, f"more than {limit} entries")
        key_hint, val_hint = args
        if key_hint is not str:
            raise TypeError(f"only dict[str, X] is supported at {path}")
        return {
            _check_str(k, f"{path}.<key>", None): _convert(v, val_hint, f"{path}.{k}", json_mode, None)
            for k, v in value.items()
        }
    if isinstance(hint, type) and issubclass(hint, Message):
        if type(value) is not dict:
            _fail(path, f"expected object, got {type(value).__name__}")
        return _build(hint, value, json_mode, path)
    raise TypeError(f"unsupported type hint {hint!r} at {path}")


def _build(cls: type[M], fields: dict[Any, Any], json_mode: bool, path: str) -> M:
    specs = field_specs(cls)
    known = {s.wire_name for s in specs}
    unknown = [k for k in fields if k not in known]
    if unknown:
        shown = ", ".join(repr(k)[:40] for k in unknown[:3])
        raise MessageError(f"{path or cls.TYPE_TAG}: unknown field(s) {shown}")
    kwargs: dict[str, Any] = {}
    for spec in specs:
        sub_path = f"{path}.{spec.wire_name}" if path else spec.wire_name
        if spec.wire_name not in fields:
            if spec.required:
                _fail(sub_path, "missing")
            continue
        kwargs[spec.name] = _convert(
            fields[spec.wire_name], spec.hint, sub_path, json_mode, spec.max_len
        )
    try:
        msg = cls(**kwargs)
    except (TypeError, ValueError) as exc:  # a __post_init__ of a nested type
        raise MessageError(f"{path or cls.TYPE_TAG}: {exc}") from None
    msg.check()
    return msg


def from_wire(cls: type[M], fields: dict[Any, Any], *, json_mode: bool) -> M:
    """Build and validate a ``cls`` from its wire mapping (no tag/version keys).

    Raises MessageError on any mismatch. Pure: ``fields`` is not mutated.
    """
    return _build(cls, fields, json_mode, "")


def _to_wire_value(value: Any, json_mode: bool) -> Any:
    if isinstance(value, Message):
        return to_wire(value, json_mode=json_mode)
    if type(value) is tuple or type(value) is list:
        if value and isinstance(value[0], Message):
            return [_to_wire_value(v, json_mode) for v in value]
        return value if not json_mode else list(value)
    if type(value) is bytes and json_mode:
        return base64.b64encode(value).decode("ascii")
    if type(value) is dict and any(isinstance(v, Message | bytes) for v in value.values()):
        return {k: _to_wire_value(v, json_mode) for k, v in value.items()}
    return value


def to_wire(msg: Message, *, json_mode: bool) -> dict[str, Any]:
    """The wire mapping of ``msg`` (field wire names → plain values). Pure.

    In JSON mode bytes become base64 strings and unset optional (None) fields are omitted.
    """
    out: dict[str, Any] = {}
    for spec in field_specs(type(msg)):
        value = getattr(msg, spec.name)
        if json_mode and value is None and not spec.required:
            continue  # operators read JSON: leave out optional fields that are unset
        out[spec.wire_name] = _to_wire_value(value, json_mode)
    return out


def truncate_text(text: str, max_chars: int) -> str:
    """``text`` cut to at most ``max_chars`` characters (with a marker when cut)."""
    if len(text) <= max_chars:
        return text
    return text[: max(0, max_chars - 3)] + "..."
