"""Fake workers for the controller's tests: each is a registry record plus a telemetry
stream on a real bus (no engine), and optionally answers switch commands; with helpers to
start them and to watch the controller's decisions and switch commands."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from shared.bus import Bus, BusConfig
from shared.bus.registration import WorkerRegistration
from shared.bus.registry import RegistryConfig
from shared.messages import (
    ControllerDecision,
    StreamSequencer,
    Subjects,
    SwitchCommand,
    SwitchReply,
    WorkerRecord,
)
from tests.support.worker_messages import worker_record, worker_telemetry

SUBJECTS = Subjects()
HEARTBEAT_S = 0.2


async def wait_for(pred: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll ``pred`` (telemetry has no event to wait on from outside the controller)."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def wait_any_switched(workers: list[FakeWorker], timeout_s: float = 10.0) -> None:
    """Until one of ``workers`` has got a switch command (raises TimeoutError)."""
    waits = [asyncio.ensure_future(w.switched.wait()) for w in workers]
    try:
        await asyncio.wait_for(asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED), timeout_s)
    finally:
        for t in waits:
            t.cancel()


@contextlib.asynccontextmanager
async def decisions_on(url: str) -> AsyncIterator[list[ControllerDecision]]:
    """The controller's published decisions, appended as they arrive while inside."""
    got: list[ControllerDecision] = []

    async def on_decision(msg: ControllerDecision) -> None:
        got.append(msg)

    async with Bus(BusConfig.from_url(url), SUBJECTS) as bus:
        await bus.subscribe_stream(SUBJECTS.controller_decisions(), ControllerDecision, on_decision)
        yield got


@contextlib.asynccontextmanager
async def started(workers: list[FakeWorker], reply: SwitchReply) -> AsyncIterator[list[FakeWorker]]:
    """``workers`` started (each answering switch commands with ``reply``), stopped after."""
    for w in workers:
        await w.start(switch_reply=reply)
    try:
        yield workers
    finally:
        for w in workers:
            await w.stop()


class FakeWorker:
    """A registry record plus a telemetry stream; optionally answers switch commands."""

    def __init__(
        self, url: str, worker_id: str, role: str, max_num_seqs: int = 64, **telemetry: float
    ) -> None:
        self.url = url
        self.worker_id = worker_id
        self.role = role
        self.max_num_seqs = max_num_seqs
        # Decode flow counters, advanced by telemetry["entered_per_publish"] / ["left_..."].
        self.entered_total = self.left_total = 0.0
        self.telemetry = {
            "free_blocks": 90,
            "total_blocks": 100,
            "ppi": 0.0,
            "dpi_load": 0.0,
            "dpi_adm": 0.0,
            "stolen_tokens_total": 0,
            "running": 0,
            **telemetry,
        }
        self.bus = Bus(BusConfig.from_url(url, name=worker_id), SUBJECTS)
        self.switches: list[SwitchCommand] = []
        self.switched = asyncio.Event()
        self._seq = StreamSequencer(worker_id)
        self._task: asyncio.Task[None] | None = None
        self.reg: WorkerRegistration | None = None

    def record(self) -> WorkerRecord:
        return worker_record(
            self.worker_id,
            self.role,  # type: ignore[arg-type]
            pid=4242,  # as its telemetry's metrics say
            kv_total_blocks=100,
            started_at_s=time.time(),
            heartbeat_at_s=time.time(),
            heartbeat_period_s=HEARTBEAT_S,
            max_num_seqs=self.max_num_seqs,
        )

    async def start(self, switch_reply: SwitchReply | None = None) -> None:
        await self.bus.start()
        if switch_reply is not None:

            async def on_switch(cmd: SwitchCommand) -> SwitchReply:
                self.switches.append(cmd)
                self.switched.set()
                return switch_reply

            await self.bus.serve(SUBJECTS.worker_switch(self.worker_id), SwitchCommand, on_switch)
        self.reg = WorkerRegistration(
            self.bus, self.record(), RegistryConfig(heartbeat_s=HEARTBEAT_S)
        )
        await self.reg.start()
        self._task = asyncio.create_task(self._publish())

    async def _publish(self) -> None:
        subject = SUBJECTS.telemetry(self.role, self.worker_id)
        while True:
            t = self.telemetry
            self.entered_total += t.get("entered_per_publish", 0.0)
            self.left_total += t.get("left_per_publish", 0.0)
            await self.bus.publish(
                subject,
                worker_telemetry(
                    self.worker_id,
                    self.role,  # type: ignore[arg-type]
                    epoch=self._seq.epoch,
                    seq=self._seq.next_seq(subject),
                    time_s=time.time(),
                    running=int(t["running"]),
                    free_blocks=int(t["free_blocks"]),
                    total_blocks=int(t["total_blocks"]),
                    ppi=t["ppi"],
                    dpi_load=t["dpi_load"],
                    dpi_adm=t["dpi_adm"],
                    stolen_tokens_total=int(t["stolen_tokens_total"]),
                    metrics={
                        "pid": 4242.0,
                        "decode_entered_total": self.entered_total,
                        "decode_left_total": self.left_total,
                        "decode_waiting": t.get("decode_waiting", 0.0),
                    },
                ),
            )
            await asyncio.sleep(0.05)  # publish period of a (fast) telemetry stream

    async def crash(self) -> None:
        """Stop heartbeats and telemetry without deregistering (as if killed)."""
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.reg:
            await self.reg.stop(deregister=False)

    async def stop(self) -> None:
        await self.crash()
        await self.bus.stop()
