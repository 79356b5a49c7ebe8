"""The strict converters of single wire values (msgpack/JSON) to Python values, the rules
shared/messages/wire_plan.py compiles message plans from: no coercion (``"1"`` is not 1,
``true`` is not 1), ints in [-2**63, 2**64), floats accept ints but not NaN, strings must be
encodable UTF-8 and within their length limit, bytes are base64 strings in JSON.

A converter takes ``(wire value, json_mode)`` and returns the Python value or raises
``WireInvalid``. Pure.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Callable
from typing import Any, cast

from shared.messages.schema import DEFAULT_MAX_STR_CHARS, INT_MAX, INT_MIN

Conv = Callable[[Any, bool], Any]  # (wire value, json_mode) -> Python value


class WireInvalid(Exception):
    """A wire value failed its check; ``path`` grows as the error bubbles up. Internal to the
    messages package: from_wire/validate turn it into MessageError."""

    def __init__(self, why: str, path: list[str] | None = None) -> None:
        super().__init__(why)
        self.why = why
        self.path = path or []


def type_name(value: Any) -> str:
    return type(value).__name__


def conv_int(v: Any, j: bool) -> int:
    if type(v) is not int:
        raise WireInvalid(f"expected integer, got {type_name(v)}")
    if not INT_MIN <= v <= INT_MAX:
        raise WireInvalid("integer out of range")
    return v


def conv_float(v: Any, j: bool) -> float:
    if type(v) is float:
        if math.isnan(v):
            raise WireInvalid("NaN is not allowed")
        return v
    if type(v) is int:
        return float(conv_int(v, j))
    raise WireInvalid(f"expected number, got {type_name(v)}")


def conv_bool(v: Any, j: bool) -> bool:
    if type(v) is not bool:
        raise WireInvalid(f"expected boolean, got {type_name(v)}")
    return v


def conv_bytes(v: Any, j: bool) -> bytes:
    if j and type(v) is str:
        try:
            return base64.b64decode(v.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError, ValueError):
            raise WireInvalid("expected base64 string") from None
    if type(v) is not bytes:
        raise WireInvalid(f"expected bytes, got {type_name(v)}")
    return v


def conv_none(v: Any, j: bool) -> None:
    if v is not None:
        raise WireInvalid("expected null")


def str_converter(max_len: int | None) -> Conv:
    """The converter of a string field of at most ``max_len`` characters (None: the default)."""
    limit = DEFAULT_MAX_STR_CHARS if max_len is None else max_len

    def conv(v: Any, j: bool) -> str:
        if type(v) is not str:
            raise WireInvalid(f"expected string, got {type_name(v)}")
        if len(v) > limit:
            raise WireInvalid(f"string longer than {limit} characters")
        if not v.isascii():
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise WireInvalid("string is not valid unicode") from None
        return v

    return conv


def check_sequence(v: Any, limit: int) -> list[Any] | tuple[Any, ...]:
    """``v`` itself if it is an array of at most ``limit`` items. Raises WireInvalid."""
    if type(v) is not list and type(v) is not tuple:
        raise WireInvalid(f"expected array, got {type_name(v)}")
    if len(v) > limit:
        raise WireInvalid(f"more than {limit} items")
    return cast(list[Any], v)
