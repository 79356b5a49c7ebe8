"""The dual-role worker runtime: one process, one engine, both roles' machinery.

``WorkerRuntime`` is an async context manager. Entering it loads the engine, starts the UCX
transfer node, connects the bus, serves this worker's subjects, starts the loops and
registers in the registry; ``stop()`` (idempotent) undoes it in reverse order.

The runtime is the top of the package: it builds every part with what that part needs
(``WorkerStatus`` for role and state, the roles, the policy, peers, telemetry, the switcher)
and nothing below it refers back to it. Every handler goes through the bus's one wrapper
(decode, time, count, error reply). The engine runs in one dedicated thread; the block
manager is touched only on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from services.common.service import Service
from services.worker.config import PREFILL_CHUNK_TOKENS, WorkerConfig
from services.worker.decode.decode_role import DecodeRole
from services.worker.engine_factory import build_engine
from services.worker.failure import FailurePath
from services.worker.handlers import WorkerHandlers
from services.worker.metrics import WorkerMetrics, start_metrics_server
from services.worker.peers import Peers
from services.worker.policy import WorkerPolicy, load_policy_config, worker_profile
from services.worker.prefill.prefill_role import PrefillRole
from services.worker.record import worker_record
from services.worker.role_switch.migration import Migrator
from services.worker.role_switch.switch import RoleSwitcher
from services.worker.role_switch.switch_lease import SwitchLease
from services.worker.state_events import StateAnnouncer
from services.worker.status import WorkerStatus
from services.worker.telemetry import Telemetry
from services.worker.token_stream import TokenFlusher, TokenStreamer
from services.worker.transfer_endpoints import open_transfer
from shared.aio import cancel_and_wait
from shared.bus import Bus
from shared.bus.registration import WorkerRegistration
from shared.bus.registry import RegistryConfig
from shared.bus.registry_watcher import RegistryWatcher
from shared.engine.interface import StepEngine
from shared.messages import (
    AdmitRequest,
    CancelRequest,
    MigrateRequest,
    PrefillRequest,
    Role,
    StreamSequencer,
    Subjects,
    SwitchCommand,
)
from shared.policy.roles import ACTIVE, STOPPING, WorkerState

log = structlog.get_logger(__name__)


class WorkerRuntime(Service):
    """A worker process's services. Use as ``async with WorkerRuntime(cfg) as rt``."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.subjects = Subjects(cfg.subject_prefix)
        self.metrics_registry = CollectorRegistry()
        self.status = WorkerStatus(cfg.role)
        self.started_at_s = time.time()
        self._stack = contextlib.AsyncExitStack()
        self._tasks: list[asyncio.Task[Any]] = []
        self._stopped = False
        self.engine: StepEngine  # set in start()

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        cfg = self.cfg
        wid = cfg.worker_id
        loop = asyncio.get_running_loop()
        # The bus first: a wrong URL or credentials fail in seconds, before the model loads.
        bus = self.bus = Bus(
            dataclasses.replace(cfg.bus, name=f"worker-{wid}"),
            self.subjects,
            registry=self.metrics_registry,
        )
        await self._stack.enter_async_context(bus)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"engine-{wid}")
        engine = self.engine = await loop.run_in_executor(self.executor, build_engine, cfg)
        engine.reslice(self.status.role)  # a prefill worker's arena lends its workspace
        transfer = await open_transfer(cfg, engine, self._stack)
        self.node, sender, receiver = transfer.node, transfer.sender, transfer.receiver
        secret = cfg.secret_bytes
        self.sequencer = StreamSequencer(wid)
        self.announcer = StateAnnouncer(
            wid, self.status, bus, self.subjects, self.sequencer, self._write_record
        )
        self.failure = FailurePath(
            wid,
            set_state=self.announcer.set_state,
            block_manager=engine.block_manager,
            transfer_timeout_s=cfg.transfer_timeout_s,
            heartbeat_s=cfg.heartbeat_s,
        )
        streamer = TokenStreamer(self.sequencer)
        self.flusher = TokenFlusher(streamer, bus, self.subjects, wid)
        self.metrics = WorkerMetrics(self.metrics_registry, wid)
        self.watcher = RegistryWatcher(bus)
        self.peers = Peers(wid, bus, self.subjects, self.watcher)
        policy = self.policy = WorkerPolicy(
            load_policy_config(cfg),
            worker_profile(cfg, engine),
            self.peers,
            self.status,
            self.metrics,
            force_steal_ratio=cfg.force_steal_ratio,
            recalibrate=cfg.recalibrate,
            idle_chunk_tokens=PREFILL_CHUNK_TOKENS,
        )
        fluidtoken = cfg.fluidtoken  # without it: no split planner, no decode budgets
        self.decode = DecodeRole(
            engine,
            receiver,
            streamer,
            self.executor,
            self.flusher.request_flush,
            transfer_timeout_s=cfg.transfer_timeout_s,
            max_num_seqs=cfg.max_num_seqs,
            prefill_chunk_tokens=PREFILL_CHUNK_TOKENS,
            decode_reserve_tokens=cfg.decode_reserve_tokens,
            suffix_allowance=policy.suffix_allowance if fluidtoken else None,
            chunk_budget=policy.chunk_tokens if fluidtoken else None,
            observe_stage=self.metrics.observe_stage,
            observe_step=policy.observe_decode,
            on_engine_failure=self.failure.on_engine_failure,
        )
        self.prefill = PrefillRole(
            wid,
            engine,
            bus,
            self.subjects,
            sender,
            streamer,
            self.executor,
            self.flusher.request_flush,
            flush_now=self.flusher.flush_now,
            deliver_now=self.flusher.deliver_now,
            secret=secret,
            admit_timeout_s=cfg.admit_timeout_s,
            transfer_timeout_s=cfg.transfer_timeout_s,
            decode_wait_s=cfg.decode_wait_timeout_s,
            expire_margin_s=cfg.expire_margin,
            split_planner=policy.split_plan if fluidtoken else None,
            repair=self.peers.pick_decode_worker,
            find_capacity=self.peers.decode_with_capacity,
            observe_stage=self.metrics.observe_stage,
            observe_step=policy.observe_prefill,
        )
        if cfg.metrics_port:
            runner = await start_metrics_server(
                self.metrics_registry,
                cfg.metrics_host,
                cfg.metrics_port,
                before_scrape=self._refresh_metrics,
            )
            self._stack.push_async_callback(runner.cleanup)
        self.handlers = WorkerHandlers(
            wid,
            self.status,
            self.prefill,
            self.decode,
            bus,
            self.subjects,
            vocab_size=int(engine.tokenizer.vocab_size),
        )
        s, h = self.subjects, self.handlers
        await bus.serve(s.worker_prefill(wid), PrefillRequest, h.on_prefill, max_concurrency=64)
        await bus.serve(s.worker_admit(wid), AdmitRequest, h.on_admit, max_concurrency=64)
        await bus.serve(s.worker_cancel(wid), CancelRequest, h.on_cancel, max_concurrency=64)
        self.switcher = RoleSwitcher(
            wid,
            self.status,
            self.announcer,
            SwitchLease(wid, bus, self.subjects, self.peers.active),
            self.prefill,
            self.decode,
            Migrator(
                wid,
                bus,
                self.subjects,
                engine,
                sender,
                self.decode.table,
                secret=secret,
                transfer_timeout_s=cfg.transfer_timeout_s,
                deliver_now=self.flusher.deliver_now,
            ),
            bus,
            self.subjects,
            follow_role=self.peers.follow_role,
            active_peers=self.peers.active,
            reslice=engine.reslice,
            migrate=cfg.migrate,
            migrate_min_remaining_s=cfg.migrate_min_remaining_s,
        )
        await bus.serve(s.worker_switch(wid), SwitchCommand, self.switcher.on_switch)
        await bus.serve(s.worker_migrate(wid), MigrateRequest, h.on_migrate, max_concurrency=16)
        await self.watcher.start()
        self._stack.push_async_callback(self.watcher.stop)
        self.telemetry = Telemetry(
            wid,
            bus,
            self.subjects,
            self.sequencer,
            self.status,
            policy,
            self.peers,
            decode_stats=self.decode.stats,
            prefill_stats=self.prefill.stats,
            switch_stats=self.switcher.stats,
            interval_s=cfg.telemetry_interval_s,
        )
        await self.peers.follow_role(self.status.role)
        self.telemetry.start()
        self._tasks += [
            asyncio.ensure_future(self.decode.run()),
            asyncio.ensure_future(self.prefill.run()),
            asyncio.ensure_future(self.flusher.run()),
        ]
        self.status.set_state(ACTIVE)
        record = worker_record(cfg, self.status, engine, self.node.address, self.started_at_s)
        self.registration = WorkerRegistration(
            bus, record, RegistryConfig(heartbeat_s=cfg.heartbeat_s)
        )
        await self.registration.start()
        log.info("worker_started", worker_id=wid, role=self.status.role, **engine.describe())

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.status.set_state(STOPPING)
        registration = getattr(self, "registration", None)
        if registration is not None:
            with contextlib.suppress(Exception):
                await registration.stop()
        telemetry = getattr(self, "telemetry", None)
        if telemetry is not None:
            await telemetry.stop()
        peers = getattr(self, "peers", None)
        if peers is not None:
            await peers.stop()
        await cancel_and_wait(self._tasks)
        failure = getattr(self, "failure", None)
        if failure is not None:
            await failure.stop()
        prefill = getattr(self, "prefill", None)
        if prefill is not None:
            prefill.cancel_background()
        await self._stack.aclose()
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.shutdown(wait=True)

    async def _write_record(self, role: Role, state: WorkerState) -> None:
        """A state change, to the registry at once (the announcer's write)."""
        await self.registration.update(role=role, state=state)

    def _refresh_metrics(self) -> None:
        self.metrics.refresh(
            self.status.role,
            self.status.state,
            self.policy.signals(),
            self.policy.profile,
            self.decode.stats(),
            self.prefill.stats(),
            self.switcher.stats(),
        )

    # ------------------------------------------------------------------ failure
    @property
    def fatal(self) -> asyncio.Event:
        """Set when the worker must exit (engine failure, failure.py) with
        ``exit_status``."""
        return self.failure.fatal

    @property
    def exit_status(self) -> int:
        return self.failure.exit_status
