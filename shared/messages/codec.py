"""Encode/decode messages: msgpack on the wire, plain JSON accepted on control subjects.

Wire form (msgpack): a map of the message's fields plus ``"_t"`` (type tag) and ``"_v"``
(schema version), both required. JSON form: the same map as a JSON object; ``_t``/``_v``
are optional on input (an operator types ``{"role":"prefill"}``) and present on output.
A payload is JSON when its first non-whitespace byte is ``{`` — that byte (0x7b) and
whitespace are msgpack positive fixints, never a valid msgpack message, so the detection
is unambiguous. An empty payload counts as ``{}`` for JSON-accepting types.

Every failure is a :class:`MessageError`; nothing else escapes :func:`decode`.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

import msgpack

from shared.messages.common import ErrorReply
from shared.messages.limits import MAX_MESSAGE_BYTES
from shared.messages.schema import Message, MessageError, MessageTooLargeError
from shared.messages.wire_plan import from_wire, to_wire, validate

TAG_KEY = "_t"
VERSION_KEY = "_v"
_JSON_WHITESPACE = b" \t\r\n"

M = TypeVar("M", bound=Message)


def is_json(data: bytes) -> bool:
    """True when ``data`` is (meant to be) JSON: first non-whitespace byte is ``{``."""
    return data.lstrip(_JSON_WHITESPACE)[:1] == b"{"


def encode(
    msg: Message,
    *,
    json_mode: bool = False,
    max_bytes: int = MAX_MESSAGE_BYTES,
    check: bool = True,
) -> bytes:
    """Encode ``msg`` (msgpack, or JSON when ``json_mode``).

    With ``check`` the message is validated exactly as a receiver would check it, so we
    never send what the other side must reject. Raises MessageError (invalid message) or
    MessageTooLargeError (encoded size > ``max_bytes``). Pure.
    """
    if check:
        validate(msg)
    body: dict[str, Any] = to_wire(msg, json_mode=json_mode)
    body[TAG_KEY] = msg.TYPE_TAG
    body[VERSION_KEY] = msg.SCHEMA_VERSION
    if json_mode:
        data = json.dumps(body, separators=(",", ":"), allow_nan=True).encode("utf-8")
    else:
        data = msgpack.packb(body, use_bin_type=True)
    if len(data) > max_bytes:
        raise MessageTooLargeError(
            f"{msg.TYPE_TAG} encodes to {len(data)} bytes, limit is {max_bytes}"
        )
    return data


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _parse(data: bytes, accepts_json: bool) -> tuple[dict[Any, Any], bool]:
    """Parse bytes to the top-level mapping; returns (mapping, was_json)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise MessageError("payload must be bytes")
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"payload of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    raw = bytes(data)
    stripped = raw.strip(_JSON_WHITESPACE)
    if not stripped or stripped[:1] == b"{":
        if not accepts_json:
            raise MessageError("this subject takes msgpack, not JSON")
        if not stripped:
            return {}, True
        try:
            obj = json.loads(stripped.decode("utf-8"), parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            raise MessageError(f"invalid JSON: {str(exc)[:120]}") from None
        if type(obj) is not dict:
            raise MessageError("JSON payload must be an object")
        return obj, True
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises many types (ExtraData, FormatError, ...)
        raise MessageError(f"invalid msgpack: {type(exc).__name__}") from None
    if type(obj) is not dict:
        raise MessageError("msgpack payload must be a map")
    return obj, False


def _check_envelope(fields: dict[Any, Any], cls: type[Message], was_json: bool) -> None:
    tag = fields.pop(TAG_KEY, None)
    version = fields.pop(VERSION_KEY, None)
    if tag is None and not was_json:
        raise MessageError("missing type tag")
    if tag is not None and tag != cls.TYPE_TAG:
        raise MessageError(f"expected {cls.TYPE_TAG}, got {str(tag)[:64]!r}")
    if version is None and not was_json:
        raise MessageError("missing schema version")
    if version is not None and (type(version) is not int or version != cls.SCHEMA_VERSION):
        raise MessageError(
            f"{cls.TYPE_TAG}: schema version {str(version)[:16]} not supported "
            f"(expected {cls.SCHEMA_VERSION})"
        )


def decode_with_format(data: bytes, expected_type: type[M]) -> tuple[M, bool]:
    """Decode ``data`` as ``expected_type``; returns (message, was_json). Raises MessageError."""
    fields, was_json = _parse(data, expected_type.JSON_ACCEPTED)
    _check_envelope(fields, expected_type, was_json)
    return from_wire(expected_type, fields, json_mode=was_json), was_json


def decode(data: bytes, expected_type: type[M]) -> M:
    """Decode ``data`` as ``expected_type`` (strictly validated). Raises MessageError."""
    return decode_with_format(data, expected_type)[0]


def decode_reply(data: bytes, reply_type: type[M]) -> M | ErrorReply:
    """Decode a reply that is either ``reply_type`` or an :class:`ErrorReply`.

    Raises MessageError when it is neither.
    """
    fields, was_json = _parse(data, True)
    tag = fields.get(TAG_KEY)
    if tag == ErrorReply.TYPE_TAG or (tag is None and was_json and "code" in fields):
        _check_envelope(fields, ErrorReply, was_json)
        return from_wire(ErrorReply, fields, json_mode=was_json)
    if was_json and not reply_type.JSON_ACCEPTED:
        raise MessageError(f"{reply_type.TYPE_TAG} replies are msgpack, not JSON")
    _check_envelope(fields, reply_type, was_json)
    return from_wire(reply_type, fields, json_mode=was_json)
