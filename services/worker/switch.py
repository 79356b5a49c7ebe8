"""FluidRole in the worker: Active(role) -> Drain -> Switch -> Active(new role), in place.

Same process, same weights, same arena; nothing is freed to the OS or reloaded. Each state
change is published as a StateEvent and written to the registry at once, so routers stop
sending work of the old role before the drain starts counting.

P -> D: stop admitting prefill work; hand queued-but-not-started requests to other Active
prefill workers (they keep their arrival time and deadline); finish the running prefill and
flush its KV export; flip. D -> P: stop admitting decode work; live-migrate requests expected
to run longer than ``migrate_min_remaining_s`` to peer decode workers, let the others finish
in place, within ``drain_timeout_s``, after which the switch is cancelled and the worker
returns to Active(decode). Any failure rolls back the same way, at once: a request that
could not be migrated (it resumes here, or fails clearly if its outcome is unknown:
migration.py), or an exception in the switch task. Admission is restored and a later
switch is accepted. The drain ends when the roles signal that their last work left
(no polling period in the switch time).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from services.worker.migration import migrate_out
from services.worker.switch_lease import SwitchLease
from shared.bus.errors import BusError
from shared.errors import BlockStateError
from shared.messages import Ack, StateEvent, SwitchCommand, SwitchReply
from shared.policy.roles import ACTIVE, DECODE, DRAIN, FAILED, PREFILL, SWITCH, Role, WorkerState

if TYPE_CHECKING:
    from services.worker.runtime import WorkerRuntime

log = structlog.get_logger(__name__)

# The roles signal when work leaves them (``progress`` events), so the drain ends on that
# signal; this period only re-checks for work that ended without one (e.g. a failed receive).
_DRAIN_RECHECK_S = 0.05
_FINISHING_S = 5.0  # bound on waiting for a finished switch's last registry write


class RoleSwitcher:
    def __init__(
        self,
        rt: WorkerRuntime,
        drain_timeout_s: float = 60.0,
        migrate: bool = True,
        migrate_min_remaining_s: float = 0.2,
    ) -> None:
        self.rt = rt
        self.migrate = migrate
        # A request expected to need longer than this to finish moves to a peer instead.
        self.migrate_min_remaining_s = migrate_min_remaining_s
        self.drain_timeout_s = drain_timeout_s
        self.task: asyncio.Task[None] | None = None
        self.lease = SwitchLease(rt)
        self._starting = False  # a command is waiting for its lease
        self.switches_total = 0
        self.last_durations_ms: dict[str, float] = {}

    async def on_switch(self, cmd: SwitchCommand) -> SwitchReply:
        """Validate, take the controller's lease (switch_lease.py) and start a switch;
        answer without waiting for it. Refused commands change nothing."""
        rt = self.rt
        if rt.state == ACTIVE and self.task is not None and not self.task.done():
            # The last switch is back to "active" and only finishing its state writes:
            # let them land first, so the registry sees the states in order.
            await asyncio.wait([self.task], timeout=_FINISHING_S)
        busy = self._starting or (self.task is not None and not self.task.done())
        if rt.state != ACTIVE or busy:
            return SwitchReply(ok=False, error=f"a switch is already running (state {rt.state})")
        if cmd.role == rt.role:
            return SwitchReply(ok=False, error=f"worker {rt.cfg.worker_id} is already {rt.role}")
        from_role = rt.role
        self._starting = True
        try:
            refusal = await self.lease.acquire(from_role, cmd.role)
        finally:
            self._starting = False
        if refusal is None and (rt.state != ACTIVE or rt.role != from_role):
            refusal = f"worker {rt.cfg.worker_id} changed meanwhile (state {rt.state})"
            await self.lease.release(rt.role)
        if refusal is not None:
            return SwitchReply(ok=False, error=refusal)
        self.task = asyncio.ensure_future(self._run(rt.role, cmd.role))
        return SwitchReply(ok=True, from_role=rt.role, to_role=cmd.role)

    async def set_state(self, state: WorkerState, reason: str) -> None:
        """Set the worker's state, write it to the registry and publish a StateEvent.
        A failure to publish is logged, never raised."""
        rt = self.rt
        if rt.state == FAILED:
            return  # terminal (engine failure): nothing overrides it
        old, rt.state = rt.state, state
        event = StateEvent(
            publisher_id=rt.cfg.worker_id,
            epoch=rt.sequencer.epoch,
            seq=rt.sequencer.next_seq("events"),
            time_s=time.time(),
            role=rt.role,
            from_state=old,
            to_state=state,
            reason=reason,
        )
        try:
            await rt.registration.update(role=rt.role, state=state)
            await rt.bus.publish(rt.subjects.events(rt.cfg.worker_id), event)
        except Exception:
            log.exception("state_publish_failed", worker_id=rt.cfg.worker_id, state=state)
        log.info(
            "worker_state", worker_id=rt.cfg.worker_id, role=rt.role, state=state, reason=reason
        )

    async def _run(self, from_role: Role, to_role: Role) -> None:
        """The switch task. Any failure rolls back to Active(from_role) with admission
        restored, so a later switch is accepted (nothing is left in drain)."""
        try:
            await self._switch(from_role, to_role)
        except Exception as exc:
            log.exception(
                "switch_failed", worker_id=self.rt.cfg.worker_id, error=type(exc).__name__
            )
            await self._roll_back(from_role, f"switch failed: {type(exc).__name__}")
        finally:
            await self.lease.release(self.rt.role)  # no-op unless an exception skipped it

    async def _roll_back(self, from_role: Role, reason: str) -> None:
        """Back to Active(``from_role``): undo the flip if it happened, admit again."""
        rt = self.rt
        if rt.decode.engine_failed:
            return  # terminal: services/worker/failure.py takes the worker out
        if rt.role != from_role:
            self._reslice(from_role)
            rt.role = from_role
            with contextlib.suppress(Exception):
                await rt.telemetry.follow_role(from_role)
        rt.prefill.admitting = rt.decode.admitting = True
        await self.lease.release(rt.role)  # before "active": a next command may come at once
        await self.set_state(ACTIVE, reason)

    async def _switch(self, from_role: Role, to_role: Role) -> None:
        rt = self.rt
        t0 = time.perf_counter()
        await self.set_state(DRAIN, f"switch {from_role}->{to_role}")
        if from_role == PREFILL:
            rt.prefill.admitting = False
            await self._hand_off_queue()
            drained = await self._wait(
                lambda: (
                    rt.prefill.current is None and not rt.prefill.exports and not rt.prefill.queue
                ),
                rt.prefill.progress,
            )
        else:
            rt.decode.admitting = False
            if self.migrate and not await self._migrate_long_requests():
                # A request that must move could not (refused, rejected ticket, failed
                # transfer): it resumed here, and waiting for it to end in place would
                # outlast the drain budget. Give the switch up now.
                log.warning("switch_cancelled", worker_id=rt.cfg.worker_id, reason="migration")
                await self._roll_back(from_role, "switch cancelled: a migration failed")
                return
            drained = await self._wait(lambda: not rt.decode.requests, rt.decode.progress)
        t_drain = time.perf_counter()
        if not drained:
            log.warning("switch_cancelled", worker_id=rt.cfg.worker_id, reason="drain timeout")
            await self._roll_back(from_role, "switch cancelled: drain deadline")
            return
        await self.set_state(SWITCH, f"{from_role}->{to_role}")
        t_reslice = time.perf_counter()
        lent_blocks = self._reslice(to_role)
        reslice_s = time.perf_counter() - t_reslice
        rt.role = to_role
        await rt.telemetry.follow_role(to_role)
        rt.prefill.admitting = rt.decode.admitting = True
        await self.lease.release(to_role)  # before "active": a next command may come at once
        await self.set_state(ACTIVE, f"now {to_role}")
        self.switches_total += 1
        self.last_durations_ms = {
            "drain_ms": (t_drain - t0) * 1e3,
            "reslice_ms": reslice_s * 1e3,
            # the registry writes and state events that make routers see the new role
            "route_update_ms": (time.perf_counter() - t_drain - reslice_s) * 1e3,
        }
        log.info(
            "switch_done",
            worker_id=rt.cfg.worker_id,
            to=to_role,
            workspace_blocks=lent_blocks,
            **self.last_durations_ms,
        )

    def _reslice(self, to_role: Role) -> int:
        """Re-slice the arena for the new role (Engine.reslice). Runs on the event loop
        while drained (no forward runs, the block manager is loop-owned). A tail still in
        use (a late reservation) only skips the workspace: the switch goes on."""
        try:
            return int(self.rt.engine.reslice(to_role))
        except BlockStateError as exc:
            log.warning("reslice_skipped", worker_id=self.rt.cfg.worker_id, reason=str(exc))
            return 0

    async def _wait(self, done: Callable[[], bool], progress: asyncio.Event) -> bool:
        """Until ``done()`` (True) or the drain deadline (False). Re-checked whenever the
        role sets ``progress`` (cleared before each check, so no signal is lost)."""
        deadline = time.monotonic() + self.drain_timeout_s
        while True:
            progress.clear()
            if done():
                return True
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(remaining_s, _DRAIN_RECHECK_S)):
                    await progress.wait()

    async def _migrate_long_requests(self) -> bool:
        """Move every long-running request to a peer. False if one of them stayed here
        (each request is settled by ``migrate_out`` either way: never left frozen)."""
        rt = self.rt
        dec = rt.decode
        peers = [r.worker_id for r in rt.active_peers(DECODE)]
        if not peers:
            return True  # fall back to waiting, bounded by the drain deadline
        step_s = max(dec.last_step_s, 1e-3)
        moves = []
        for req in list(dec.runnable):
            remaining = req.seq.params.max_tokens - len(req.seq.output_token_ids)
            if remaining * step_s > self.migrate_min_remaining_s:
                moves.append(req.request_id)
        # All leave the batch at the same step boundary and move concurrently, so the drain
        # is about one step plus one transfer, not their sum.
        results = await asyncio.gather(
            *(
                migrate_out(rt, rid, peers[i % len(peers) :] + peers[: i % len(peers)])
                for i, rid in enumerate(moves)
            ),
            return_exceptions=True,
        )
        return all(r is True for r in results)

    async def _hand_off_queue(self) -> None:
        """Give queued prefill requests to other Active prefill workers, keeping deadlines."""
        rt = self.rt
        jobs = rt.prefill.take_queued()
        targets = [r.worker_id for r in rt.active_peers(PREFILL)]
        for i, job in enumerate(jobs):
            placed = False
            for k in range(len(targets)):
                target = targets[(i + k) % len(targets)]
                try:
                    await rt.prefill.hand_over(job, target, PREFILL)
                    await rt.bus.request(rt.subjects.worker_prefill(target), job.msg, Ack, 2.0)
                    placed = True
                    break
                except (BusError, Exception):
                    continue
            if not placed:  # nobody took it: serve it here before switching
                await rt.prefill.hand_over(job, rt.cfg.worker_id, PREFILL)
                rt.prefill.queue.append(job)
                rt.prefill.jobs[job.request_id] = job
                rt.prefill.wakeup.set()
