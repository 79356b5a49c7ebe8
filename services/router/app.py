"""The router process: ``async with Router(cfg) as router`` starts the bus, the registry
watcher, the token/telemetry subscriptions and the HTTP server; ``stop()`` (idempotent)
undoes it all. Never imports torch or shared.engine (beyond the torch-free tiny tokenizer).

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics. Every handler runs inside one middleware (middleware.py) that turns typed
errors into OpenAI-style JSON (4xx for bad input) and anything unexpected into a logged 500.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from services.common.service import Service
from services.router.admission import AdmissionGate
from services.router.config import RouterConfig
from services.router.dispatch import Dispatcher
from services.router.errors import ApiError, BadRequest
from services.router.generate import GenerationHandler
from services.router.metrics import RouterMetrics
from services.router.middleware import error_middleware
from services.router.openai_api import (
    GenerationRequest,
    parse_chat,
    parse_completion,
    resolve_max_tokens,
)
from services.router.pressure_pairing import PressurePolicy, make_policy
from services.router.prompt_limits import MAX_BODY_BYTES, PromptLimits
from shared.bus import Bus
from shared.bus.registry_watcher import RegistryWatcher
from shared.messages import Subjects, TokenBatch, WorkerRecord, WorkerTelemetry
from shared.policy.roles import ACTIVE, DECODE, ROLES, Role
from shared.tokenizer import Tokenizer
from shared.tokenizer.models import load_tokenizer

log = structlog.get_logger("fluidpd.router")
# A body larger than this is decoded, templated and tokenized on the router's parse thread,
# so a big prompt does not hold the event loop (every other stream's tokens) while it is
# parsed; a smaller one is parsed inline, where the thread hop would cost more than it.
PARSE_OFF_LOOP_BYTES = 64 * 1024
# Pending-connection queue of the listening socket (aiohttp's default is 128). Under a burst
# on a busy host the loop accepts late and a 128-deep queue overflows into refused/reset
# connections that never reach admission (an overloaded router must answer 503, not drop
# SYNs). 2048 is uvicorn's default; the kernel caps it at net.core.somaxconn.
LISTEN_BACKLOG = 2048


def decode_json(raw: bytes) -> Any:
    """The JSON value of a request body. Raises BadRequest (400) for invalid JSON and for
    nesting deeper than the interpreter's recursion limit (a 500 otherwise)."""
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BadRequest("the request body is not valid JSON") from None
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None


async def read_body(request: web.Request, limit_bytes: int) -> bytes:
    """The request body, refused (413) once it is over ``limit_bytes``: at once when its
    Content-Length says so, else as soon as what arrived passes the limit, so an oversized
    body is never held in full. Reading awaits the socket: a slow sender costs this
    request's time, never the event loop's. Raises HTTPRequestEntityTooLarge."""
    declared = request.content_length
    if declared is not None and declared > limit_bytes:
        raise web.HTTPRequestEntityTooLarge(max_size=limit_bytes, actual_size=declared)
    body = bytearray()
    while chunk := await request.content.readany():
        body += chunk
        if len(body) > limit_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=limit_bytes, actual_size=len(body))
    return bytes(body)


class Router(Service):
    """One router. Not thread-safe (one event loop)."""

    def __init__(self, cfg: RouterConfig, tokenizer: Tokenizer | None = None) -> None:
        self.cfg = cfg
        self.subjects = Subjects(cfg.subject_prefix)
        self.registry = CollectorRegistry()
        self.metrics = RouterMetrics.create(self.registry, cfg.model_name)
        self.tokenizer = tokenizer
        self.policy = make_policy(
            cfg.pairing, cfg.telemetry_stale_s, ttft_s=cfg.ttft_slo_ms / 1000.0
        )
        self.gate: AdmissionGate | None = None
        shedding = cfg.shedding
        if shedding.sheds or shedding.decode_backlog_batches > 0:
            self.gate = AdmissionGate(
                shedding,
                cfg.ttft_slo_ms / 1000.0,
                stale_after_s=cfg.telemetry_stale_s,
                decode_records=lambda: self.active_workers(DECODE),
            )
        self.bus: Bus | None = None
        self.watcher: RegistryWatcher | None = None
        self.dispatcher: Dispatcher | None = None
        self.generation: GenerationHandler | None = None
        self._runner: web.AppRunner | None = None
        self._parse_executor: ThreadPoolExecutor | None = None
        self.port = cfg.port
        self._stopped = False

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    # --- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Connect, watch the registry, subscribe, listen. Raises BusError, ModelLoadError,
        TimeoutError (registry), OSError (port in use)."""
        cfg = self.cfg
        if self.tokenizer is None:
            self.tokenizer = await asyncio.to_thread(load_tokenizer, cfg.model)
        self.bus = Bus(
            dataclasses.replace(cfg.bus, name=cfg.id), self.subjects, registry=self.registry
        )
        await self.bus.start()
        self.dispatcher = Dispatcher(
            cfg, self.bus, self.subjects, self.active_workers, self.policy, self.metrics
        )
        self.watcher = RegistryWatcher(self.bus, on_change=self.dispatcher.on_registry_change)
        await self.watcher.start(timeout_s=cfg.registry_timeout_s)
        await self.bus.subscribe_stream(
            self.subjects.router_tokens_in(cfg.id),
            TokenBatch,
            self.dispatcher.on_tokens,
            on_gap=self.dispatcher.on_stream_gap,
        )
        self.bus.add_reconnect_listener(self.dispatcher.on_bus_reconnected)
        observers: list[Callable[[WorkerTelemetry], None]] = []
        if isinstance(self.policy, PressurePolicy):
            observers.append(self.policy.observe)
        if self.gate is not None:
            observers.append(self.gate.observe)
        if observers:

            async def on_telemetry(msg: WorkerTelemetry) -> None:
                for observe in observers:
                    observe(msg)

            await self.bus.subscribe_stream(
                self.subjects.telemetry_all(), WorkerTelemetry, on_telemetry
            )
        self.generation = GenerationHandler(
            self.dispatcher,
            self.tokenizer,
            cfg.model_name,
            self.metrics,
            cfg.request_timeout_s,
            gate=self.gate,
            short_prompt_tokens=cfg.short_prompt_tokens,
            stream_header_hold_s=cfg.header_hold_s,
        )
        self._parse_executor = ThreadPoolExecutor(1, thread_name_prefix="router-parse")
        # handler_cancellation: a client that leaves cancels its handler, also while a
        # stream's headers are held (generate.py), so its request is cancelled on the workers.
        self._runner = web.AppRunner(self.build_app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, cfg.host, cfg.port, backlog=LISTEN_BACKLOG)
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            self.port = sockets[0].getsockname()[1]
        log.info(
            "router_ready",
            url=self.url,
            router_id=cfg.id,
            model=cfg.model_name,
            pairing=cfg.pairing,
        )

    async def stop(self) -> None:
        """Stop serving, end in-flight requests, close the bus. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self.dispatcher is not None:
            await self.dispatcher.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        if self.watcher is not None:
            await self.watcher.stop()
        if self.bus is not None:
            await self.bus.stop()
        if self._parse_executor is not None:
            self._parse_executor.shutdown(wait=False, cancel_futures=True)

    # --- registry views -----------------------------------------------------------------
    def active_workers(self, role: Role) -> list[WorkerRecord]:
        return [] if self.watcher is None else self.watcher.workers(role, ACTIVE)

    def max_model_len(self) -> int | None:
        """Context limit: the smallest over live workers (None when none is registered)."""
        records = [] if self.watcher is None else self.watcher.workers()
        return min((r.max_model_len for r in records), default=None)

    def prompt_limits(self) -> PromptLimits | None:
        """The prompt-text and body bounds of the current context limit (None when no
        worker is registered: the body is then held to MAX_BODY_BYTES only)."""
        limit = self.max_model_len()
        if limit is None or self.tokenizer is None:
            return None
        return PromptLimits(limit, self.tokenizer.max_token_chars)

    # --- HTTP ---------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        middleware = error_middleware(self.cfg.api_key, self.metrics)
        # The ceiling for every route; the generation routes read their body themselves
        # against the (lower) limit of the context (read_body, PromptLimits).
        app = web.Application(middlewares=[middleware], client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        assert self.tokenizer is not None and self.generation is not None
        limits = self.prompt_limits()
        raw = await read_body(request, MAX_BODY_BYTES if limits is None else limits.body_bytes)
        parse = parse_chat if kind == "chat" else parse_completion
        tokenizer, model_name = self.tokenizer, self.cfg.model_name

        def work() -> GenerationRequest:
            return parse(decode_json(raw), tokenizer, model_name, limits)

        if len(raw) > PARSE_OFF_LOOP_BYTES and self._parse_executor is not None:
            loop = asyncio.get_running_loop()
            req = await loop.run_in_executor(self._parse_executor, work)
        else:
            req = work()
        limit = self.max_model_len()
        if limit is None:
            raise ApiError(
                "no workers are registered; retry later",
                code="no_active_workers",
                http_status=503,
                retry_after_s=1,
            )
        max_tokens = resolve_max_tokens(req, limit)
        return await self.generation.run(request, req, max_tokens)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _models(self, request: web.Request) -> web.Response:
        limit = self.max_model_len()
        model: dict[str, Any] = {
            "id": self.cfg.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "fluidpd",
            "root": self.cfg.model,
        }
        if limit is not None:
            model["max_model_len"] = limit
        return web.json_response({"object": "list", "data": [model]})

    async def _health(self, request: web.Request) -> web.Response:
        missing = [r for r in ROLES if not self.active_workers(r)]
        if self.bus is None or not self.bus.is_connected:
            return web.json_response(
                {"status": "unavailable", "reason": "not connected to NATS"}, status=503
            )
        if missing:
            return web.json_response(
                {
                    "status": "unavailable",
                    "reason": "no active " + " or ".join(missing) + " worker",
                },
                status=503,
            )
        return web.json_response({"status": "ok"})

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
