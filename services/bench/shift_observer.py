"""What ``fluidpd bench shift`` sees on the bus: the controller's decisions, the workers'
state events and their latest telemetry, each with its receive time.

The analysis of a run (services/bench/shift_analysis.py) reads only this record.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.bus import Bus
from shared.bus.config import BusConfig
from shared.messages import ControllerDecision, StateEvent, Subjects, WorkerTelemetry
from shared.policy.roles import ACTIVE, PREFILL


@dataclass
class Observer:
    """Everything published on the bus that the analysis needs, with receive times
    (this process's monotonic clock). Event-loop only."""

    nats_url: str
    decisions: list[tuple[float, ControllerDecision]] = field(default_factory=list)
    events: list[tuple[float, StateEvent]] = field(default_factory=list)
    telemetry: dict[str, WorkerTelemetry] = field(default_factory=dict)
    prefill_ppi: list[tuple[float, float]] = field(default_factory=list)  # (t, PPI) if > 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    bus: Bus | None = None

    async def __aenter__(self) -> Observer:
        subjects = Subjects()
        self.bus = Bus(BusConfig.from_url(self.nats_url, name="bench-shift"), subjects)
        await self.bus.start()
        await self.bus.subscribe_stream(
            subjects.controller_decisions(), ControllerDecision, self._on_decision
        )
        await self.bus.subscribe_stream(subjects.events("*"), StateEvent, self._on_event)
        await self.bus.subscribe_stream(
            subjects.telemetry_all(), WorkerTelemetry, self._on_telemetry
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.bus is not None:
            await self.bus.stop()

    def _pulse(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    async def _on_decision(self, msg: ControllerDecision) -> None:
        self.decisions.append((time.monotonic(), msg))
        self._pulse()

    async def _on_event(self, msg: StateEvent) -> None:
        self.events.append((time.monotonic(), msg))
        self._pulse()

    async def _on_telemetry(self, msg: WorkerTelemetry) -> None:
        self.telemetry[msg.publisher_id] = msg
        if msg.role == PREFILL and msg.state == ACTIVE and msg.ppi > 0:
            self.prefill_ppi.append((time.monotonic(), msg.ppi))
        self._pulse()

    async def wait_until(self, predicate: Any, timeout_s: float) -> bool:
        """True once ``predicate()`` holds (re-checked on every message), False at timeout."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            changed = self.changed
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                return predicate()
        return True

    def idle(self, worker_ids: Sequence[str]) -> bool:
        """Every worker reports no work and every KV block free."""
        tel = [self.telemetry.get(w) for w in worker_ids]
        return all(
            t is not None
            and t.state == ACTIVE
            and t.free_blocks == t.total_blocks
            and t.running == 0
            and t.queue_len == 0
            for t in tel
        )
