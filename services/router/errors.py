"""Errors the router answers with, in OpenAI's shape (``{"error": {message, type, param,
code}}``). Each carries its HTTP status; ``retry_after_s`` adds a Retry-After header."""

from __future__ import annotations

from typing import Any

from services.router.streams import StreamEnd
from shared.errors import FluidPDError, InvalidRequestError


class ApiError(FluidPDError):
    """An error reply with an explicit status, OpenAI ``type``, ``param`` and ``code``."""

    code = "api_error"
    http_status = 500
    error_type = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        http_status: int | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if http_status is not None:
            self.http_status = http_status
        self.retry_after_s = retry_after_s


class BadRequest(ApiError, InvalidRequestError):
    """400: the request body is invalid (wrong type, out of range, too long, ...)."""

    code = "invalid_request_error"
    http_status = 400
    error_type = "invalid_request_error"


class ModelNotFound(ApiError):
    code = "model_not_found"
    http_status = 404
    error_type = "invalid_request_error"


class Unavailable(ApiError):
    """503: no worker could take the request now; retry later."""

    code = "service_unavailable"
    http_status = 503
    error_type = "server_error"


def error_body(
    message: str, error_type: str, code: str | None, param: str | None = None
) -> dict[str, Any]:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_type_for(status: int) -> str:
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


def end_to_error(end: StreamEnd) -> ApiError:
    """A failed stream end as an HTTP error (503 + Retry-After when capacity ran out)."""
    code = end.error_code or "worker_error"
    message = end.error or f"the request ended with {end.finish_reason}"
    if code == "request_timeout":
        return ApiError(message, code=code, http_status=504)
    retry = (
        1
        if code
        in (
            "kv_capacity_exhausted",
            "worker_lost",
            "router_stopping",
            "stream_gap",
            "bus_reconnected",
            "deadline_expired",
            "decode_wait_timeout",
        )
        else None
    )
    return ApiError(message, code=code, http_status=503, retry_after_s=retry)
