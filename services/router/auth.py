"""The router's API key (``--api-key`` / ``$FLUIDPD_API_KEY``), checked as vLLM does: every
``/v1/...`` route needs ``Authorization: Bearer <key>``; ``/health`` and ``/metrics`` stay
open (probes and Prometheus scrape them without credentials, and they carry no prompt or
output). A missing or wrong key is answered 401 in OpenAI's error shape."""

from __future__ import annotations

import hashlib
import hmac

from services.router.errors import ApiError

PROTECTED_PREFIX = "/v1"


class Unauthorized(ApiError):
    """401: no API key, or the wrong one."""

    code = "invalid_api_key"
    http_status = 401
    error_type = "invalid_request_error"


def needs_api_key(path: str) -> bool:
    """Whether ``path`` is behind the API key (the OpenAI routes). Pure."""
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")


def check_api_key(expected: str, authorization: str | None) -> None:
    """Raise Unauthorized unless ``authorization`` is ``Bearer <expected>``. The comparison
    takes the same time whatever the key (digests compared in constant time)."""
    scheme, _, given = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    want = hashlib.sha256(expected.encode()).digest()
    got = hashlib.sha256(given.strip().encode()).digest()
    if not hmac.compare_digest(want, got):
        raise Unauthorized("incorrect API key provided")
