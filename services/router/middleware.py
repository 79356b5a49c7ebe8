"""The router's one HTTP middleware: every handler runs inside it. It checks the API key
(with ``--api-key``), turns every typed error into an OpenAI-style JSON error with its
status (a 404/405 from routing too) and anything unexpected into a logged 500, and counts
each request by endpoint and status (499: the client left)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware

from services.router.auth import Unauthorized, check_api_key, needs_api_key
from services.router.errors import ApiError, error_body, error_type_for
from services.router.metrics import RouterMetrics
from shared.errors import FluidPDError

log = structlog.get_logger("fluidpd.router")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


def error_response(exc: Exception) -> web.Response:
    """OpenAI-style error JSON for ``exc`` (typed errors keep their status and code)."""
    if isinstance(exc, ApiError):
        status, code, message, param = exc.http_status, exc.code, exc.message, exc.param
    elif isinstance(exc, FluidPDError):
        status, code, message, param = exc.http_status, exc.code, str(exc), None
    else:
        status, code, message, param = 500, "internal_error", "internal server error", None
    headers = {}
    retry = getattr(exc, "retry_after_s", None)
    if retry:
        headers["Retry-After"] = str(retry)
    return web.json_response(
        error_body(message, error_type_for(status), code, param), status=status, headers=headers
    )


def error_middleware(api_key: str, metrics: RouterMetrics) -> Middleware:
    """The middleware for a router whose key is ``api_key`` ('' = none) and whose request
    and error counters are in ``metrics``. Never raises for a handler's error (answers it);
    a cancelled handler (client gone) is counted and re-raised."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        endpoint = request.path if request.path in ENDPOINTS else "other"
        try:
            if api_key and needs_api_key(request.path):
                try:
                    check_api_key(api_key, request.headers.get("Authorization"))
                except Unauthorized:
                    metrics.unauthorized_total.inc()
                    raise
            response = await handler(request)
        except web.HTTPException as exc:  # 404/405 from routing: OpenAI shape as well
            response = web.json_response(
                error_body(
                    exc.reason, error_type_for(exc.status), exc.reason.lower().replace(" ", "_")
                ),
                status=exc.status,
            )
        except FluidPDError as exc:
            response = error_response(exc)
            metrics.errors_total.labels(code=exc.code).inc()
        except (asyncio.CancelledError, ConnectionResetError):
            metrics.requests_total.labels(endpoint=endpoint, status="499").inc()
            raise
        except Exception:
            log.exception("handler_failed", endpoint=endpoint)
            metrics.errors_total.labels(code="internal_error").inc()
            response = error_response(RuntimeError())
        metrics.requests_total.labels(endpoint=endpoint, status=str(response.status)).inc()
        return response

    return middleware
