"""The controller: aggregates telemetry, serves cluster status, runs FluidRole.

Usage::

    async with Controller(ControllerConfig(bus=BusConfig.from_url(url))) as ctl:
        await ctl.wait_closed()   # or do other things; exiting the block stops it

Every ``decision_interval_s`` it builds a ClusterSnapshot (registry + latest telemetry),
calls ``RolePolicy.decide``, publishes the decision (taken or not) as ControllerDecision
and logs it with its inputs. A decided switch is sent to the worker (SwitchCommand, by
request) only when ``auto`` is on; a refusal or timeout is logged and the loop carries on
(the policy's cooldown still applies, so a broken worker is not hammered).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import structlog
from prometheus_client import start_http_server

from services.common.service import Service, announce_ready
from services.controller.config import ControllerConfig
from services.controller.leases import SwitchLeases
from services.controller.metrics import ControllerMetrics
from services.controller.status import WorkerBook
from shared.bus import Bus, BusError, RemoteError
from shared.bus.registry import RegistryConfig
from shared.bus.registry_watcher import RegistryChange, RegistryWatcher
from shared.messages import (
    ControllerDecision,
    PolicyCommand,
    PolicyReply,
    StatusReply,
    StatusRequest,
    StreamSequencer,
    Subjects,
    SwitchCommand,
    SwitchLeaseReply,
    SwitchLeaseRequest,
    SwitchReply,
    WorkerTelemetry,
)
from shared.policy.fluidrole import Decision, RolePolicy
from shared.policy.roles import DECODE, PREFILL

log = structlog.get_logger("fluidpd.controller")


class Controller(Service):
    """One controller process's state. Not thread-safe; one event loop."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.subjects = Subjects(config.subject_prefix)
        self.metrics = ControllerMetrics.create()
        self.policy = RolePolicy(config.policy)
        self.policy.paused = not config.auto
        self.book = WorkerBook(config.policy.window_s, config.telemetry_stale_s)
        self.leases = SwitchLeases()
        self.bus = Bus(
            dataclasses.replace(config.bus, name=config.controller_id),
            self.subjects,
            registry=self.metrics.registry,
        )
        self.watcher = RegistryWatcher(
            self.bus, RegistryConfig(heartbeat_s=config.heartbeat_s), on_change=self._on_change
        )
        self.sequencer = StreamSequencer(config.controller_id)
        self.last_decision: Decision | None = None
        self.decisions_total = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._http: Any = None
        self._closed = asyncio.Event()
        self._started = False
        self._stopped = False

    # --- lifecycle ----------------------------------------------------------------------
    @property
    def auto(self) -> bool:
        return not self.policy.paused

    async def start(self) -> None:
        """Connect, watch the registry, subscribe, serve, start the policy loop.

        Raises BusConnectionError when NATS is unreachable, TimeoutError when the registry
        snapshot does not load.
        """
        self._started = True
        await self.bus.start()
        await self.watcher.start()
        s = self.subjects
        await self.bus.subscribe_stream(s.telemetry_all(), WorkerTelemetry, self._on_telemetry)
        await self.bus.serve(s.controller_status(), StatusRequest, self._on_status)
        await self.bus.serve(s.controller_policy(), PolicyCommand, self._on_policy)
        await self.bus.serve(s.controller_switch_lease(), SwitchLeaseRequest, self._on_lease)
        await self.bus.flush()
        if self.config.metrics_port:
            self._http = start_http_server(
                self.config.metrics_port, self.config.metrics_host, self.metrics.registry
            )
        self._loop_task = asyncio.create_task(self._decision_loop(), name="controller-policy")
        log.info(
            "controller_started",
            nats=",".join(url.split("@")[-1] for url in self.config.bus.servers),
            auto=self.auto,
            decision_interval_s=self.config.decision_interval_s,
            metrics_port=self.config.metrics_port,
        )

    async def stop(self) -> None:
        """Stop the loop, pending switch requests, the watcher and the bus. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        tasks = [*self._tasks, *([self._loop_task] if self._loop_task else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.watcher.stop()
        await self.bus.stop()
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join(2.0)
            self._http = None
        self._closed.set()
        log.info("controller_stopped", decisions=self.decisions_total)

    async def wait_closed(self) -> None:
        await self._closed.wait()

    # --- inputs -------------------------------------------------------------------------
    def _on_change(self, change: RegistryChange) -> None:
        if change.kind == "removed":
            self.book.forget(change.worker_id)
            self.leases.forget(change.worker_id)

    async def _on_telemetry(self, msg: WorkerTelemetry) -> None:
        self.book.observe(msg, time.monotonic())

    # --- request handlers ---------------------------------------------------------------
    def status(self) -> StatusReply:
        """The cluster status now (one row per registered worker). Pure."""
        rows = self.book.rows(self.watcher.workers(), time.monotonic())
        return StatusReply(auto=self.auto, time_s=time.time(), workers=tuple(rows))

    async def _on_status(self, req: StatusRequest) -> StatusReply:
        reply = self.status()
        if req.role is not None:
            reply = StatusReply(
                auto=reply.auto,
                time_s=reply.time_s,
                workers=tuple(w for w in reply.workers if w.role == req.role),
            )
        return reply

    def set_auto(self, auto: bool) -> None:
        """Pause (False) or resume (True) automatic switching. Mutates the policy."""
        if auto != self.auto:
            log.info("controller_policy_mode", auto=auto)
        self.policy.paused = not auto

    async def _on_policy(self, cmd: PolicyCommand) -> PolicyReply:
        self.set_auto(cmd.auto)
        return PolicyReply(ok=True, auto=self.auto)

    async def _on_lease(self, msg: SwitchLeaseRequest) -> SwitchLeaseReply:
        """Grant or refuse a worker's switch (services/controller/leases.py), or release."""
        now_s = time.monotonic()
        if msg.release:
            self.leases.release(msg.worker_id, msg.from_role, now_s)
            log.info("switch_lease_released", worker_id=msg.worker_id, role=msg.from_role)
            return SwitchLeaseReply(ok=True)
        refusal = self.leases.acquire(
            msg.worker_id, msg.from_role, msg.to_role, self.watcher.workers(), now_s
        )
        log.info(
            "switch_lease",
            worker_id=msg.worker_id,
            from_role=msg.from_role,
            to_role=msg.to_role,
            granted=refusal is None,
            reason=refusal,
        )
        return SwitchLeaseReply(ok=refusal is None, error=refusal)

    # --- policy loop --------------------------------------------------------------------
    async def decide_once(self) -> Decision:
        """Run one decision interval: decide, publish, log, and maybe send a switch."""
        now_s = time.monotonic()
        snapshot = self.book.snapshot(self.watcher.workers(), now_s)
        decision = self.policy.decide(snapshot, now_s)
        self.last_decision = decision
        self.decisions_total += 1
        m = self.metrics
        m.decisions_total.labels(action=decision.action).inc()
        m.ppi_bar.set(decision.ppi_bar)
        m.dpi_load_bar.set(decision.dpi_load_bar)
        m.dpi_adm_bar.set(decision.dpi_adm_bar)
        m.workers.labels(role=PREFILL).set(decision.active_prefill)
        m.workers.labels(role=DECODE).set(decision.active_decode)
        inputs = decision.inputs(len(snapshot.workers))
        event = "controller_switch_decided" if decision.switches else "controller_decision"
        log.info(
            event,
            action=decision.action,
            worker_id=decision.worker_id,
            worker_ids=list(decision.worker_ids),
            target_role=decision.target_role,
            reason=decision.reason,
            recommendation=decision.recommendation,
            **inputs,
        )
        subject = self.subjects.controller_decisions()
        msg = ControllerDecision(
            publisher_id=self.config.controller_id,
            epoch=self.sequencer.epoch,
            seq=self.sequencer.next_seq(subject),
            time_s=time.time(),
            action=decision.action,
            target_worker_id=decision.worker_id,
            reason=decision.reason,
            inputs=inputs,
        )
        try:
            await self.bus.publish(subject, msg)
        except BusError as exc:
            log.warning("controller_publish_failed", error=str(exc))
        if decision.switches and decision.target_role:
            # ADAPTIVE rules may size a move at several workers; PAPER names one.
            for worker_id in decision.worker_ids or (decision.worker_id,):
                if not worker_id:
                    continue
                task = asyncio.create_task(
                    self.send_switch(worker_id, decision.target_role), name="switch"
                )
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        return decision

    async def send_switch(self, worker_id: str, role: str) -> SwitchReply | None:
        """Ask ``worker_id`` to switch to ``role``; returns its reply, None on failure
        (logged, counted). Never raises BusError."""
        subject = self.subjects.worker_switch(worker_id)
        command = SwitchCommand(role=role)  # type: ignore[arg-type]  # validated on encode
        try:
            reply = await self.bus.request(
                subject, command, SwitchReply, self.config.switch_timeout_s
            )
        except (BusError, RemoteError) as exc:
            self.metrics.switches_total.labels(outcome="error").inc()
            log.warning("controller_switch_failed", worker_id=worker_id, role=role, error=str(exc))
            return None
        outcome = "ok" if reply.ok else "refused"
        self.metrics.switches_total.labels(outcome=outcome).inc()
        log.info(
            "controller_switch_reply",
            worker_id=worker_id,
            role=role,
            ok=reply.ok,
            error=reply.error,
        )
        return reply

    async def _decision_loop(self) -> None:
        interval_s = self.config.decision_interval_s
        next_s = time.monotonic() + interval_s
        while True:
            await asyncio.sleep(max(0.0, next_s - time.monotonic()))  # fixed-rate ticker
            try:
                await self.decide_once()
            except Exception:  # a bug in one interval must not stop the controller
                log.exception("controller_decision_failed")
            next_s = max(next_s + interval_s, time.monotonic())


async def run_until_signalled(config: ControllerConfig, stop: asyncio.Event) -> None:
    """Run a controller until ``stop`` is set."""
    async with Controller(config):
        announce_ready("controller_ready")
        await stop.wait()
