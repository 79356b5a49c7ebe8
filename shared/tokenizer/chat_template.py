"""Render a model's Jinja chat template the way HF transformers does.

Same environment as ``transformers.utils.chat_template_utils._compile_jinja_template``: an
immutable sandbox with ``trim_blocks``/``lstrip_blocks`` and ``loopcontrols``, a ``tojson`` filter
that does not HTML-escape, and the globals ``raise_exception`` and ``strftime_now``. Templates come
from model files, which are untrusted input: the sandbox is what keeps them from reaching Python.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared.errors import InvalidRequestError


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template. Construct once per tokenizer; ``render`` is thread-safe."""

    def __init__(self, source: str, special_tokens: dict[str, str | None]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self._special_tokens = dict(special_tokens)
        self._template = env.from_string(source)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render ``messages``. Raises InvalidRequestError when the template rejects them
        (``raise_exception`` in the template, or a malformed message)."""
        for message in messages:
            if not isinstance(message, dict):
                raise InvalidRequestError(
                    f"chat messages must be objects, got {type(message).__name__}"
                )
        try:
            return self._template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequestError(f"chat template rejected the messages: {exc}") from exc
        except (TypeError, KeyError, AttributeError) as exc:
            raise InvalidRequestError(f"chat messages do not fit the chat template: {exc}") from exc
