"""Announcing a worker's state: the registry record is rewritten at once and a
``StateEvent`` is published, so routers stop sending work of a role before a drain starts
counting (switch.py) and see ``failed`` at once (failure.py)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import structlog

from services.worker.status import WorkerStatus
from shared.bus import Bus
from shared.messages import StateEvent, StreamSequencer, Subjects
from shared.policy.roles import Role, WorkerState

log = structlog.get_logger(__name__)


class StateAnnouncer:
    """The one writer of ``status.state`` after start-up. Holds no state of its own."""

    def __init__(
        self,
        worker_id: str,
        status: WorkerStatus,
        bus: Bus,
        subjects: Subjects,
        sequencer: StreamSequencer,
        write_record: Callable[[Role, WorkerState], Awaitable[None]],
    ) -> None:
        """``write_record(role, state)``: rewrite this worker's registry record now."""
        self.worker_id = worker_id
        self._status = status
        self._bus = bus
        self._subjects = subjects
        self._sequencer = sequencer
        self._write_record = write_record

    async def set_state(self, state: WorkerState, reason: str) -> None:
        """Set the worker's state, write it to the registry and publish a StateEvent.
        ``failed`` is terminal (nothing overrides it). A failure to publish is logged,
        never raised."""
        status = self._status
        if status.failed:
            return  # terminal (engine failure): nothing overrides it
        old = status.set_state(state)
        event = StateEvent(
            publisher_id=self.worker_id,
            epoch=self._sequencer.epoch,
            seq=self._sequencer.next_seq("events"),
            time_s=time.time(),
            role=status.role,
            from_state=old,
            to_state=state,
            reason=reason,
        )
        try:
            await self._write_record(status.role, state)
            await self._bus.publish(self._subjects.events(self.worker_id), event)
        except Exception:
            log.exception("state_publish_failed", worker_id=self.worker_id, state=state)
        log.info(
            "worker_state", worker_id=self.worker_id, role=status.role, state=state, reason=reason
        )
