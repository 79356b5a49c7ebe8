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
switch is accepted. An engine failure meanwhile ends the switch where it stands (no flip,
no re-opened admission): the worker is terminal (failure.py). The drain ends when the
roles signal that their last work left (no polling period in the switch time).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence

import structlog

from services.worker.decode.decode_role import DecodeRole
from services.worker.prefill.prefill_role import PrefillRole
from services.worker.role_switch.migration import Migrator
from services.worker.role_switch.switch_lease import SwitchLease
from services.worker.state_events import StateAnnouncer
from services.worker.stats import SwitchStats
from services.worker.status import WorkerStatus
from shared.bus import Bus
from shared.bus.errors import BusError
from shared.errors import BlockStateError
from shared.messages import Ack, Subjects, SwitchCommand, SwitchReply, WorkerRecord
from shared.policy.roles import ACTIVE, DECODE, DRAIN, PREFILL, SWITCH, Role

log = structlog.get_logger(__name__)

# The roles signal when work leaves them (``progress`` events), so the drain ends on that
# signal; this period only re-checks for work that ended without one (e.g. a failed receive).
_DRAIN_RECHECK_S = 0.05
_FINISHING_S = 5.0  # bound on waiting for a finished switch's last registry write


async def wait_drained(done: Callable[[], bool], progress: asyncio.Event, timeout_s: float) -> bool:
    """Until ``done()`` (True) or ``timeout_s`` passed (False). Re-checked whenever the
    role sets ``progress`` (cleared before each check, so no signal is lost)."""
    deadline = time.monotonic() + timeout_s
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


class RoleSwitcher:
    """Runs one switch at a time. The only writer of ``status.role`` (``set_role``)."""

    def __init__(
        self,
        worker_id: str,
        status: WorkerStatus,
        announcer: StateAnnouncer,
        lease: SwitchLease,
        prefill: PrefillRole,
        decode: DecodeRole,
        migrator: Migrator,
        bus: Bus,
        subjects: Subjects,
        *,
        follow_role: Callable[[Role], Awaitable[None]],
        active_peers: Callable[[Role], Sequence[WorkerRecord]],
        reslice: Callable[[Role], int],
        drain_timeout_s: float = 60.0,
        migrate: bool = True,
        migrate_min_remaining_s: float = 0.2,
    ) -> None:
        """``follow_role``: listen to the new role's peer telemetry (peers.py);
        ``active_peers(role)``: the other Active workers of ``role``; ``reslice``: the
        engine's arena re-slice for a role (returns the workspace blocks lent)."""
        self.worker_id = worker_id
        self._status = status
        self._announcer = announcer
        self.lease = lease
        self._prefill = prefill
        self._decode = decode
        self._migrator = migrator
        self._bus = bus
        self._subjects = subjects
        self._follow_role = follow_role
        self._active_peers = active_peers
        self._reslice_engine = reslice
        self.migrate = migrate
        # A request expected to need longer than this to finish moves to a peer instead.
        self.migrate_min_remaining_s = migrate_min_remaining_s
        self.drain_timeout_s = drain_timeout_s
        self.task: asyncio.Task[None] | None = None
        self._starting = False  # a command is waiting for its lease
        self.switches_total = 0
        self.last_durations_ms: dict[str, float] = {}

    def stats(self) -> SwitchStats:
        return SwitchStats(self.switches_total, dict(self.last_durations_ms))

    async def on_switch(self, cmd: SwitchCommand) -> SwitchReply:
        """Validate, take the controller's lease (switch_lease.py) and start a switch;
        answer without waiting for it. Refused commands change nothing."""
        st = self._status
        if st.state == ACTIVE and self.task is not None and not self.task.done():
            # The last switch is back to "active" and only finishing its state writes:
            # let them land first, so the registry sees the states in order.
            await asyncio.wait([self.task], timeout=_FINISHING_S)
        busy = self._starting or (self.task is not None and not self.task.done())
        if st.state != ACTIVE or busy:
            return SwitchReply(ok=False, error=f"a switch is already running (state {st.state})")
        if cmd.role == st.role:
            return SwitchReply(ok=False, error=f"worker {self.worker_id} is already {st.role}")
        from_role = st.role
        self._starting = True
        try:
            refusal = await self.lease.acquire(from_role, cmd.role)
        finally:
            self._starting = False
        if refusal is None and (st.state != ACTIVE or st.role != from_role):
            refusal = f"worker {self.worker_id} changed meanwhile (state {st.state})"
            await self.lease.release(st.role)
        if refusal is not None:
            return SwitchReply(ok=False, error=refusal)
        self.task = asyncio.ensure_future(self._run(st.role, cmd.role))
        return SwitchReply(ok=True, from_role=st.role, to_role=cmd.role)

    async def _run(self, from_role: Role, to_role: Role) -> None:
        """The switch task. Any failure rolls back to Active(from_role) with admission
        restored, so a later switch is accepted (nothing is left in drain)."""
        try:
            await self._switch(from_role, to_role)
        except Exception as exc:
            log.exception("switch_failed", worker_id=self.worker_id, error=type(exc).__name__)
            await self._roll_back(from_role, f"switch failed: {type(exc).__name__}")
        finally:
            await self.lease.release(self._status.role)  # no-op unless an exception skipped it

    async def _roll_back(self, from_role: Role, reason: str) -> None:
        """Back to Active(``from_role``): undo the flip if it happened, admit again."""
        if self._decode.engine_failed:
            return  # terminal: services/worker/failure.py takes the worker out
        if self._status.role != from_role:
            self._reslice(from_role)
            self._status.set_role(from_role)
            with contextlib.suppress(Exception):
                await self._follow_role(from_role)
        self._set_admitting(True)
        await self.lease.release(
            self._status.role
        )  # before "active": a next command may come at once
        await self._announcer.set_state(ACTIVE, reason)

    async def _switch(self, from_role: Role, to_role: Role) -> None:
        prefill, decode = self._prefill, self._decode
        t0 = time.perf_counter()
        await self._announcer.set_state(DRAIN, f"switch {from_role}->{to_role}")
        if from_role == PREFILL:  # prefill work is refused by the Drain state (handlers.py)
            await self._hand_off_queue()
            drained = await wait_drained(prefill.drained, prefill.progress, self.drain_timeout_s)
        else:
            decode.set_admitting(False)
            if self.migrate and not await self._migrate_long_requests():
                # A request that must move could not (refused, rejected ticket, failed
                # transfer): it resumed here, and waiting for it to end in place would
                # outlast the drain budget. Give the switch up now.
                log.warning("switch_cancelled", worker_id=self.worker_id, reason="migration")
                await self._roll_back(from_role, "switch cancelled: a migration failed")
                return
            drained = await wait_drained(decode.drained, decode.progress, self.drain_timeout_s)
        if decode.engine_failed:
            # It failed meanwhile (terminal): no flip, no re-opened admission; the failure
            # path (services/worker/failure.py) takes the worker out.
            return
        t_drain = time.perf_counter()
        if not drained:
            log.warning("switch_cancelled", worker_id=self.worker_id, reason="drain timeout")
            await self._roll_back(from_role, "switch cancelled: drain deadline")
            return
        await self._announcer.set_state(SWITCH, f"{from_role}->{to_role}")
        t_reslice = time.perf_counter()
        lent_blocks = self._reslice(to_role)
        reslice_s = time.perf_counter() - t_reslice
        self._status.set_role(to_role)
        await self._follow_role(to_role)
        self._set_admitting(True)
        await self.lease.release(to_role)  # before "active": a next command may come at once
        await self._announcer.set_state(ACTIVE, f"now {to_role}")
        self.switches_total += 1
        self.last_durations_ms = {
            "drain_ms": (t_drain - t0) * 1e3,
            "reslice_ms": reslice_s * 1e3,
            # the registry writes and state events that make routers see the new role
            "route_update_ms": (time.perf_counter() - t_drain - reslice_s) * 1e3,
        }
        log.info(
            "switch_done",
            worker_id=self.worker_id,
            to=to_role,
            workspace_blocks=lent_blocks,
            **self.last_durations_ms,
        )

    def _reslice(self, to_role: Role) -> int:
        """Re-slice the arena for the new role (Engine.reslice). Runs on the event loop
        while drained (no forward runs, the block manager is loop-owned). A tail still in
        use (a late reservation) only skips the workspace: the switch goes on."""
        try:
            return int(self._reslice_engine(to_role))
        except BlockStateError as exc:
            log.warning("reslice_skipped", worker_id=self.worker_id, reason=str(exc))
            return 0

    def _set_admitting(self, admitting: bool) -> None:
        self._decode.set_admitting(admitting)

    async def _migrate_long_requests(self) -> bool:
        """Move every long-running request to a peer. False if one of them stayed here
        (each request is settled by ``migrate_out`` either way: never left frozen)."""
        # Only Active decode workers of the registry: never one that is itself leaving
        # (draining, switching); one whose drain we do not see yet refuses the move
        # (handlers.on_migrate), and the next peer is tried.
        peers = [r.worker_id for r in self._active_peers(DECODE)]
        if not peers:
            # Fall back to waiting for the requests to end here, bounded by the drain
            # deadline (then the switch is cancelled, not failed).
            log.info("migration_no_active_peer", worker_id=self.worker_id)
            return True
        moves = self._decode.long_running(self.migrate_min_remaining_s)
        # All leave the batch at the same step boundary and move concurrently, so the drain
        # is about one step plus one transfer, not their sum.
        results = await asyncio.gather(
            *(
                self._migrator.migrate_out(rid, peers[i % len(peers) :] + peers[: i % len(peers)])
                for i, rid in enumerate(moves)
            ),
            return_exceptions=True,
        )
        return all(r is True for r in results)

    async def _hand_off_queue(self) -> None:
        """Give queued prefill requests to other Active prefill workers, keeping deadlines."""
        prefill = self._prefill
        jobs = prefill.take_queued()
        targets = [r.worker_id for r in self._active_peers(PREFILL)]
        for i, job in enumerate(jobs):
            placed = False
            for k in range(len(targets)):
                target = targets[(i + k) % len(targets)]
                try:
                    await prefill.hand_over(job, target, PREFILL)
                    await self._bus.request(
                        self._subjects.worker_prefill(target), job.msg, Ack, 2.0
                    )
                    placed = True
                    break
                except (BusError, Exception):
                    continue
            if not placed:  # nobody took it: serve it here before switching
                await prefill.hand_over(job, self.worker_id, PREFILL)
                prefill.requeue(job)
