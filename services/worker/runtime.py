"""The dual-role worker runtime: one process, one engine, both roles' machinery.

``WorkerRuntime`` is an async context manager. Entering it loads the engine, starts the UCX
transfer node, connects the bus, serves this worker's subjects, starts the loops and
registers in the registry; ``stop()`` (idempotent) undoes it in reverse order.

Every handler goes through the bus's one wrapper (decode, time, count, error reply). The
engine runs in one dedicated thread; the block manager is touched only on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from services.common.service import Service
from services.worker.config import WorkerConfig
from services.worker.decode_choice import pick_with_capacity
from services.worker.decode_role import DecodeRole
from services.worker.engine_factory import build_engine, fingerprint_of
from services.worker.failure import fail_worker
from services.worker.metrics import WorkerMetrics, start_metrics_server
from services.worker.prefill_job import PrefillJob
from services.worker.prefill_role import PrefillRole
from services.worker.switch import RoleSwitcher
from services.worker.telemetry import Telemetry
from services.worker.token_stream import TokenStreamer
from shared.aio import resolve
from shared.bus import Bus
from shared.bus.registry import RegistryConfig, RegistryWatcher, WorkerRegistration
from shared.engine.interface import StepEngine
from shared.errors import InvalidRequestError, WorkerNotActiveError
from shared.messages import (
    Ack,
    AdmitReply,
    AdmitRequest,
    CancelRequest,
    MigrateRequest,
    PrefillRequest,
    Role,
    StreamSequencer,
    Subjects,
    SwitchCommand,
    WorkerRecord,
)
from shared.policy.roles import ACTIVE, DECODE, PREFILL, STARTING, STOPPING, WorkerState
from shared.transfer.receiver import KVReceiver
from shared.transfer.sender import KVSender
from shared.transfer.ucx_node import TransferNode, TransferNodeConfig

log = structlog.get_logger(__name__)

# Used only when no cluster secret is configured (a warning is logged): local development.


class WorkerRuntime(Service):
    """A worker process's services. Use as ``async with WorkerRuntime(cfg) as rt``."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.subjects = Subjects(cfg.subject_prefix)
        self.metrics_registry = CollectorRegistry()
        self.role: Role = cfg.role
        self.state: WorkerState = STARTING
        self.started_at_s = time.time()
        self._stack = contextlib.AsyncExitStack()
        self._tasks: list[asyncio.Task[Any]] = []
        self._flush_event = asyncio.Event()
        self._flush_waiters: list[asyncio.Future[None]] = []
        self._stopped = False
        self.engine: StepEngine  # set in start()
        # Set when the worker must exit (engine failure, services/worker/failure.py); the
        # process then exits with ``exit_status``.
        self.fatal = asyncio.Event()
        self.exit_status = 0

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        # The bus first: a wrong URL or credentials fail in seconds, before the model loads.
        bus_cfg = dataclasses.replace(cfg.bus, name=f"worker-{cfg.worker_id}")
        self.bus = Bus(bus_cfg, self.subjects, registry=self.metrics_registry)
        await self._stack.enter_async_context(self.bus)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"engine-{cfg.worker_id}")
        self.engine = await loop.run_in_executor(self.executor, build_engine, cfg)
        self.engine.reslice(self.role)  # a prefill worker's arena lends its workspace
        self.vocab_size = int(self.engine.tokenizer.vocab_size)
        fingerprint = fingerprint_of(self.engine)
        self.node = TransferNode(
            TransferNodeConfig(cuda_device=cfg.device if cfg.device.startswith("cuda") else None)
        )
        await self.node.start()
        self._stack.push_async_callback(self.node.close)
        secret = self.secret = cfg.secret_bytes  # never empty (WorkerConfig checks)
        self.sender = KVSender(
            self.node, worker_id=cfg.worker_id, fingerprint=fingerprint, secret=secret
        )
        self.receiver = KVReceiver(
            self.node,
            worker_id=cfg.worker_id,
            block_manager=self.engine.block_manager,
            arena=self.engine.arena,
            fingerprint=fingerprint,
            secret=secret,
        )
        self._stack.callback(self.sender.close)
        self._stack.callback(self.receiver.close)
        self.sequencer = StreamSequencer(cfg.worker_id)
        self.streamer = TokenStreamer(self.sequencer)
        self.decode = DecodeRole(
            self.engine,
            self.receiver,
            self.streamer,
            self.executor,
            self._request_flush,
            transfer_timeout_s=cfg.transfer_timeout_s,
            max_num_seqs=cfg.max_num_seqs,
            decode_reserve_tokens=cfg.decode_reserve_tokens,
        )
        self.prefill = PrefillRole(
            cfg.worker_id,
            self.engine,
            self.bus,
            self.subjects,
            self.sender,
            self.streamer,
            self.executor,
            self._request_flush,
            flush_now=self._flush_now,
            secret=secret,
            admit_timeout_s=cfg.admit_timeout_s,
            transfer_timeout_s=cfg.transfer_timeout_s,
            decode_wait_s=cfg.decode_wait_timeout_s,
            expire_margin_s=cfg.expire_margin,
        )
        self.metrics = WorkerMetrics(self.metrics_registry, cfg.worker_id)
        self.telemetry = Telemetry(self)
        self.telemetry.install_policy()
        self.prefill.observe_stage = self.decode.observe_stage = self.metrics.observe_stage
        self.prefill.observe_step = self.telemetry.observe_prefill
        self.decode.on_engine_failure = self._on_engine_failure
        self.decode.observe_step = self.telemetry.observe_decode
        if cfg.metrics_port:
            runner = await start_metrics_server(
                self.metrics_registry,
                cfg.metrics_host,
                cfg.metrics_port,
                before_scrape=lambda: self.metrics.refresh(self),
            )
            self._stack.push_async_callback(runner.cleanup)
        wid = cfg.worker_id
        s = self.subjects
        await self.bus.serve(
            s.worker_prefill(wid), PrefillRequest, self._on_prefill, max_concurrency=64
        )
        await self.bus.serve(s.worker_admit(wid), AdmitRequest, self._on_admit, max_concurrency=64)
        await self.bus.serve(
            s.worker_cancel(wid), CancelRequest, self._on_cancel, max_concurrency=64
        )
        self.prefill.admission.repair = self.pick_decode_worker
        self.prefill.admission.find_capacity = self.decode_with_capacity
        self.switcher = RoleSwitcher(
            self, migrate=cfg.migrate, migrate_min_remaining_s=cfg.migrate_min_remaining_s
        )
        await self.bus.serve(s.worker_switch(wid), SwitchCommand, self.switcher.on_switch)
        await self.bus.serve(
            s.worker_migrate(wid), MigrateRequest, self._on_migrate, max_concurrency=16
        )
        self.watcher = RegistryWatcher(self.bus)
        await self.watcher.start()
        self._stack.push_async_callback(self.watcher.stop)
        await self.telemetry.start()
        self._tasks += [
            asyncio.ensure_future(self.decode.run()),
            asyncio.ensure_future(self.prefill.run()),
            asyncio.ensure_future(self._flusher()),
        ]
        self.state = ACTIVE
        self.registration = WorkerRegistration(
            self.bus, self.record(), RegistryConfig(heartbeat_s=cfg.heartbeat_s)
        )
        await self.registration.start()
        log.info("worker_started", worker_id=wid, role=self.role, **self.engine.describe())

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.state = STOPPING
        registration = getattr(self, "registration", None)
        if registration is not None:
            with contextlib.suppress(Exception):
                await registration.stop()
        telemetry = getattr(self, "telemetry", None)
        if telemetry is not None:
            await telemetry.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        prefill = getattr(self, "prefill", None)
        for task in [*getattr(prefill, "exports", ()), *getattr(prefill, "handoffs", ())]:
            task.cancel()
        await self._stack.aclose()
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.shutdown(wait=True)

    def record(self) -> WorkerRecord:
        eng = self.engine
        now = time.time()
        return WorkerRecord(
            worker_id=self.cfg.worker_id,
            role=self.role,
            state=self.state,
            pid=os.getpid(),
            host=self.cfg.host,
            ucx_address=self.node.address,
            model=self.cfg.model,
            fingerprint=fingerprint_of(eng).digest()[:32],
            kv_total_blocks=eng.block_manager.num_blocks,
            kv_block_size=eng.block_manager.block_size,
            max_model_len=eng.max_model_len,
            started_at_s=self.started_at_s,
            heartbeat_at_s=now,
            heartbeat_period_s=self.cfg.heartbeat_s,
            engine=eng.kind,
            decode_reserve_tokens=self.cfg.decode_reserve_tokens,
            max_num_seqs=self.cfg.max_num_seqs,
        )

    def _on_engine_failure(self, exc: BaseException) -> None:
        """The decode role already ended its requests; take the worker out (failure.py)."""
        self._tasks.append(asyncio.ensure_future(fail_worker(self, type(exc).__name__)))

    # ------------------------------------------------------------------ handlers
    def _check_vocab(self, token_ids: tuple[int, ...], field: str) -> None:
        """Refuse ids outside the model's vocabulary (the router checks; a client talking
        NATS directly may not). Raises InvalidRequestError: an id the embedding cannot look
        up would make the engine step raise and take the whole worker out (failure.py)."""
        if token_ids and max(token_ids) >= self.vocab_size:  # >= 0: the message checks it
            raise InvalidRequestError(
                f"{field}: token id {max(token_ids)} is out of the vocabulary "
                f"[0, {self.vocab_size})"
            )

    async def _on_prefill(self, msg: PrefillRequest) -> Ack:
        self._check_vocab(msg.prompt_token_ids, "prompt_token_ids")
        if self.state != ACTIVE:
            # Routers only pick Active workers; this is the race with a state change.
            raise WorkerNotActiveError(f"worker {self.cfg.worker_id} is {self.state}")
        seed = msg.sampling.seed if msg.sampling.seed is not None else 0
        if self.role == PREFILL and msg.decode_worker_id != self.cfg.worker_id:
            self.prefill.enqueue(msg, seed)
        else:
            # Routed here whole (short prompt, or this worker is the pair's decode side).
            self.decode.serve_local(msg)
        return Ack()

    async def _on_admit(self, msg: AdmitRequest) -> AdmitReply:
        self._check_vocab(msg.suffix_token_ids, "suffix_token_ids")
        if self.role != DECODE or self.state != ACTIVE:
            # Not (or no longer) a decode worker: the prefill side re-pairs the request.
            return AdmitReply(
                ok=False, error=f"worker is {self.role}/{self.state}", retry_after_ms=0
            )
        return self.decode.admit(msg)

    def active_peers(self, role: Role, exclude: str = "") -> list[WorkerRecord]:
        """Active workers of ``role`` in the registry, other than this one (and ``exclude``)."""
        skip = {self.cfg.worker_id, exclude}
        return [r for r in self.watcher.workers(role=role, state=ACTIVE) if r.worker_id not in skip]

    def pick_decode_worker(self, current: str) -> str | None:
        """An Active decode worker other than ``current`` (most KV blocks first), or None."""
        candidates = self.active_peers(DECODE, exclude=current)
        if not candidates:
            return None
        return max(candidates, key=lambda r: r.kv_total_blocks).worker_id

    def decode_with_capacity(self, current: str, job: PrefillJob) -> str | None:
        """An Active decode worker other than ``current`` whose telemetry shows room for
        ``job`` now (decode_choice.pick_with_capacity), or None."""
        return pick_with_capacity(
            self.active_peers(DECODE, exclude=current),
            self.telemetry.decode_views,
            time.monotonic(),
            prompt_tokens=job.prompt_len,
            max_tokens=job.msg.sampling.max_tokens,
        )

    async def _on_migrate(self, msg: MigrateRequest) -> AdmitReply:
        self._check_vocab(msg.generated_token_ids, "generated_token_ids")
        if self.role != DECODE or self.state != ACTIVE:
            return AdmitReply(ok=False, error=f"worker is {self.role}/{self.state}")
        return self.decode.admit_migration(msg)

    async def _on_cancel(self, msg: CancelRequest) -> None:
        found = self.prefill.cancel(msg.request_id) | self.decode.cancel(msg.request_id)
        peer = self.decode.migrated_to.pop(msg.request_id, None)
        if peer is not None:  # it lives on a peer now: pass the cancel on
            await self.bus.publish(self.subjects.worker_cancel(peer), msg)
        if found:
            log.info("request_cancelled", request_id=msg.request_id, reason=msg.reason)
        return None

    # ------------------------------------------------------------------ streaming
    def _request_flush(self) -> None:
        self._flush_event.set()

    async def _flush_now(self) -> None:
        """Return once everything pending has been handed to the bus client (whose own
        flusher, woken first, writes it before the caller runs again). A first token
        waits for this before the KV export's CPU work starts on this loop."""
        fut = asyncio.get_running_loop().create_future()
        self._flush_waiters.append(fut)
        self._flush_event.set()
        await fut

    async def _flusher(self) -> None:
        """Publishes pending token batches; one task so batches leave in order."""
        while True:
            await self._flush_event.wait()
            self._flush_event.clear()
            waiters, self._flush_waiters = self._flush_waiters, []
            for subject, batch in self.streamer.take():
                try:
                    # Under our own id: NATS lets this worker publish nowhere else.
                    own = self.subjects.tokens_from(subject, self.cfg.worker_id)
                    await self.bus.publish(own, batch)  # type: ignore[arg-type]
                except Exception:
                    log.exception("token_publish_failed", subject=subject)
            for fut in waiters:
                resolve(fut, None)
