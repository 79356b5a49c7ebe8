"""Compiled, strict conversion between messages and their wire form (msgpack/JSON values).

For each message class a plan is built once from its type hints: one converter per field
that checks a decoded value and returns the Python value (single values: wire_values.py).
Rules: no coercion (``"1"`` is not 1, ``true`` is not 1), ints in [-2**63, 2**64), floats
accept ints but not NaN, strings must be encodable UTF-8 and within ``max_len``, containers
within ``max_len`` items, no unknown and no missing required fields. The same converters validate an in-memory
message before it is sent (:func:`validate`), so we never send what a receiver rejects.

Plans are cached per class (functools.cache: memoisation of a pure function).
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

from shared.messages.schema import (
    DEFAULT_MAX_ITEMS,
    INT_MAX,
    INT_MIN,
    Message,
    MessageError,
)
from shared.messages.wire_values import (
    Conv,
    WireInvalid,
    check_sequence,
    conv_bool,
    conv_bytes,
    conv_float,
    conv_int,
    conv_none,
    str_converter,
    type_name,
)

M = TypeVar("M", bound=Message)
Enc = Callable[[Any], Any]  # Python value -> wire value


def _compile(hint: Any, max_len: int | None) -> Conv:
    """The converter for one type hint. Raises TypeError for unsupported hints."""
    simple: dict[Any, Conv] = {int: conv_int, float: conv_float, bool: conv_bool, bytes: conv_bytes}
    if hint in simple:
        return simple[hint]
    if hint is type(None):
        return conv_none
    if hint is str:
        return str_converter(max_len)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is types.UnionType or origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            raise TypeError(f"only X | None unions are supported, got {hint!r}")
        inner_conv = _compile(inner[0], max_len)
        return lambda v, j: None if v is None else inner_conv(v, j)
    if origin is Literal:
        allowed = args

        def literal(v: Any, j: bool) -> Any:
            for a in allowed:
                if type(v) is type(a) and v == a:
                    return v
            raise WireInvalid(f"expected one of {list(allowed)!r}")

        return literal
    limit = DEFAULT_MAX_ITEMS if max_len is None else max_len
    if origin is tuple:
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"only tuple[X, ...] is supported, got {hint!r}")
        if args[0] is int:  # fast path: token id lists are the big arrays

            def int_tuple(v: Any, j: bool) -> tuple[int, ...]:
                seq = check_sequence(v, limit)
                if not all(type(x) is int for x in seq):
                    raise WireInvalid("expected array of integers")
                if seq and not (min(seq) >= INT_MIN and max(seq) <= INT_MAX):
                    raise WireInvalid("integer out of range")
                return tuple(seq)

            return int_tuple
        item_conv = _compile(args[0], None)

        def tuple_conv(v: Any, j: bool) -> tuple[Any, ...]:
            out = []
            for i, x in enumerate(check_sequence(v, limit)):
                try:
                    out.append(item_conv(x, j))
                except WireInvalid as exc:
                    exc.path.insert(0, f"[{i}]")
                    raise
            return tuple(out)

        return tuple_conv
    if origin is dict:
        if args[0] is not str:
            raise TypeError(f"only dict[str, X] is supported, got {hint!r}")
        key_conv, val_conv = str_converter(None), _compile(args[1], None)

        def dict_conv(v: Any, j: bool) -> dict[str, Any]:
            if type(v) is not dict:
                raise WireInvalid(f"expected object, got {type_name(v)}")
            if len(v) > limit:
                raise WireInvalid(f"more than {limit} entries")
            out = {}
            for k, x in v.items():
                try:
                    out[key_conv(k, j)] = val_conv(x, j)
                except WireInvalid as exc:
                    exc.path.insert(0, str(k)[:32])
                    raise
            return out

        return dict_conv
    if isinstance(hint, type) and issubclass(hint, Message):
        cls = hint

        def message_conv(v: Any, j: bool) -> Any:
            if type(v) is cls:  # validating an in-memory message
                _validate(v)
                return v
            return _build(cls, v, j, nested=True)

        return message_conv
    raise TypeError(f"unsupported type hint {hint!r}")


def _compile_encoder(hint: Any, json_mode: bool) -> Enc | None:
    """Python value → wire value for one hint; None when the value goes as it is."""
    if hint is bytes:
        return (lambda v: base64.b64encode(v).decode("ascii")) if json_mode else None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is types.UnionType or origin is typing.Union:
        inner = _compile_encoder(next(a for a in args if a is not type(None)), json_mode)
        return None if inner is None else (lambda v: None if v is None else inner(v))
    if origin is tuple:
        item = _compile_encoder(args[0], json_mode)
        return None if item is None else (lambda v: [item(x) for x in v])
    if origin is dict:
        val = _compile_encoder(args[1], json_mode)
        return None if val is None else (lambda v: {k: val(x) for k, x in v.items()})
    if isinstance(hint, type) and issubclass(hint, Message):
        cls = hint
        return lambda v: _to_wire(v, cls, json_mode, nested=True)
    return None


@dataclass(frozen=True)
class _Field:
    name: str
    wire_name: str
    required: bool
    conv: Conv
    enc_msgpack: Enc | None
    enc_json: Enc | None


@dataclass(frozen=True)
class _Plan:
    fields: tuple[_Field, ...]
    known: frozenset[str]
    as_array: bool


@functools.cache
def _plan(cls: type) -> _Plan:
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        fields.append(
            _Field(
                name=f.name,
                wire_name=f.metadata.get("wire", f.name),
                required=f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING,
                conv=_compile(hint, f.metadata.get("max_len")),
                enc_msgpack=_compile_encoder(hint, False),
                enc_json=_compile_encoder(hint, True),
            )
        )
    as_array = bool(getattr(cls, "WIRE_ARRAY", False))
    return _Plan(tuple(fields), frozenset(f.wire_name for f in fields), as_array)


def _build(cls: type[M], data: Any, j: bool, nested: bool) -> M:
    plan = _plan(cast(type, cls))
    if nested and plan.as_array and type(data) is list:
        if len(data) > len(plan.fields):
            raise WireInvalid("too many array fields")
        data = {f.wire_name: v for f, v in zip(plan.fields, data, strict=False)}
    elif type(data) is not dict:
        raise WireInvalid(f"expected object, got {type_name(data)}")
    if not plan.known.issuperset(data):
        unknown = [repr(k)[:40] for k in data if k not in plan.known][:3]
        raise WireInvalid(f"unknown field(s) {', '.join(unknown)}")
    kwargs: dict[str, Any] = {}
    for f in plan.fields:
        if f.wire_name in data:
            try:
                kwargs[f.name] = f.conv(data[f.wire_name], j)
            except WireInvalid as exc:
                exc.path.insert(0, f.wire_name)
                raise
        elif f.required:
            raise WireInvalid("missing", [f.wire_name])
    msg = cls(**kwargs)
    msg.check()
    return msg


def _validate(msg: Message) -> None:
    for f in _plan(cast(type, type(msg))).fields:
        try:
            f.conv(getattr(msg, f.name), False)
        except WireInvalid as exc:
            exc.path.insert(0, f.wire_name)
            raise
    msg.check()


def _wrap(exc: WireInvalid, cls: type[Message]) -> MessageError:
    where = ".".join(exc.path)
    return MessageError(f"field {where}: {exc.why}" if where else f"{cls.TYPE_TAG}: {exc.why}")


def from_wire(cls: type[M], fields: Any, *, json_mode: bool) -> M:
    """Build and validate a ``cls`` from its wire mapping (no tag/version keys).

    Raises MessageError on any mismatch. Pure: ``fields`` is not mutated.
    """
    try:
        return _build(cls, fields, json_mode, nested=False)
    except WireInvalid as exc:
        raise _wrap(exc, cls) from None
    except (TypeError, ValueError) as exc:  # a __post_init__ of a message type
        raise MessageError(f"{cls.TYPE_TAG}: {str(exc)[:200]}") from None


def validate(msg: Message) -> None:
    """Check an in-memory message exactly as a receiver would. Raises MessageError."""
    try:
        _validate(msg)
    except WireInvalid as exc:
        raise _wrap(exc, type(msg)) from None


def _to_wire(msg: Message, cls: type, json_mode: bool, nested: bool) -> Any:
    plan = _plan(cast(type, cls))
    if nested and plan.as_array:
        encoders = [f.enc_json if json_mode else f.enc_msgpack for f in plan.fields]
        return [
            getattr(msg, f.name) if enc is None else enc(getattr(msg, f.name))
            for f, enc in zip(plan.fields, encoders, strict=True)
        ]
    out: dict[str, Any] = {}
    for f in plan.fields:
        value = getattr(msg, f.name)
        if json_mode and value is None and not f.required:
            continue  # operators read JSON: leave out optional fields that are unset
        enc = f.enc_json if json_mode else f.enc_msgpack
        out[f.wire_name] = value if enc is None else enc(value)
    return out


def to_wire(msg: Message, *, json_mode: bool) -> dict[str, Any]:
    """The wire mapping of ``msg`` (field wire names → plain values). Pure.

    In JSON mode bytes become base64 strings and unset optional (None) fields are omitted.
    """
    return cast(dict[str, Any], _to_wire(msg, type(msg), json_mode, nested=False))
