"""FluidRole in the worker: Active(role) -> Drain -> Switch -> Active(new role), in place.

Same process, same weights, same arena; nothing is freed to the OS or reloaded. Each state
change is published as a StateEvent and written to the registry at once, so routers stop
sending work of the old role before the drain starts counting.

P -> D: stop admitting prefill work; hand queued-but-not-started requests to other Active
prefill workers (they keep their arrival time and deadline); finish the running prefill and
flush its KV export; flip. D -> P: stop admitting decode work; live-migrate requests expected
to run longer than ``migrate_min_remaining_s`` to peer decode workers, let the others finish
in place, within ``drain_timeout_s``, after which the switch is cancelled and the worker
returns to Active(decode). The drain ends when the roles signal that their last work left
(no polling period in the switch time).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from shared.bus.errors import BusError
from shared.errors import BlockStateError
from shared.messages import Ack, Role, StateEvent, SwitchCommand, SwitchReply

if TYPE_CHECKING:
    from services.worker.runtime import WorkerRuntime

log = structlog.get_logger(__name__)

# The roles signal when work leaves them (``progress`` events), so the drain ends on that
# signal; this period only re-checks for work that ended without one (e.g. a failed receive).
_DRAIN_RECHECK_S = 0.05


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
        self.switches_total = 0
        self.last_durations_ms: dict[str, float] = {}

    async def on_switch(self, cmd: SwitchCommand) -> SwitchReply:
        """Validate and start a switch; answer at once. Invalid commands change nothing."""
        rt = self.rt
        if rt.state != "active" or (self.task is not None and not self.task.done()):
            return SwitchReply(ok=False, error=f"a switch is already running (state {rt.state})")
        if cmd.role == rt.role:
            return SwitchReply(ok=False, error=f"worker {rt.cfg.worker_id} is already {rt.role}")
        if not rt.active_peers(rt.role):
            return SwitchReply(ok=False, error=f"switch would leave no active {rt.role} worker")
        self.task = asyncio.ensure_future(self._run(rt.role, cmd.role))
        return SwitchReply(ok=True, from_role=rt.role, to_role=cmd.role)

    async def _set_state(self, state: str, reason: str) -> None:
        rt = self.rt
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
        rt = self.rt
        t0 = time.perf_counter()
        await self._set_state("drain", f"switch {from_role}->{to_role}")
        if from_role == "prefill":
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
            if self.migrate:
                await self._migrate_long_requests()
            drained = await self._wait(lambda: not rt.decode.requests, rt.decode.progress)
        t_drain = time.perf_counter()
        if not drained:
            log.warning("switch_cancelled", worker_id=rt.cfg.worker_id, reason="drain timeout")
            rt.prefill.admitting = rt.decode.admitting = True
            await self._set_state("active", "switch cancelled: drain deadline")
            return
        await self._set_state("switch", f"{from_role}->{to_role}")
        t_reslice = time.perf_counter()
        lent_blocks = self._reslice(to_role)
        reslice_s = time.perf_counter() - t_reslice
        rt.role = to_role
        await rt.telemetry.follow_role(to_role)
        rt.prefill.admitting = rt.decode.admitting = True
        await self._set_state("active", f"now {to_role}")
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

    async def _migrate_long_requests(self) -> None:
        rt = self.rt
        dec = rt.decode
        peers = [r.worker_id for r in rt.active_peers("decode")]
        if not peers:
            return  # fall back to waiting, bounded by the drain deadline
        step_s = max(dec.last_step_s, 1e-3)
        moves = []
        for req in list(dec.runnable):
            remaining = req.seq.params.max_tokens - len(req.seq.output_token_ids)
            if remaining * step_s > self.migrate_min_remaining_s:
                moves.append(req.request_id)
        # All leave the batch at the same step boundary and move concurrently, so the drain
        # is about one step plus one transfer, not their sum.
        await asyncio.gather(
            *(
                migrate_out(rt, rid, peers[i % len(peers) :] + peers[: i % len(peers)])
                for i, rid in enumerate(moves)
            )
        )

    async def _hand_off_queue(self) -> None:
        """Give queued prefill requests to other Active prefill workers, keeping deadlines."""
        rt = self.rt
        jobs = rt.prefill.take_queued()
        targets = [r.worker_id for r in rt.active_peers("prefill")]
        for i, job in enumerate(jobs):
            placed = False
            for k in range(len(targets)):
                target = targets[(i + k) % len(targets)]
                try:
                    await rt.bus.request(rt.subjects.worker_prefill(target), job.msg, Ack, 2.0)
                    placed = True
                    break
                except (BusError, Exception):
                    continue
            if not placed:  # nobody took it: serve it here before switching
                rt.prefill.queue.append(job)
                rt.prefill.jobs[job.request_id] = job
                rt.prefill.wakeup.set()


async def migrate_out(rt: WorkerRuntime, request_id: str, peers: list[str]) -> bool:
    """Live-migrate a running decode request to one of ``peers`` (first that accepts).

    The request leaves the batch at a step boundary, its KV moves through the same transfer
    layer as a prefill handoff, and the peer continues from the same token index with the
    same seed, so the client's stream has no gap and no repeat. Returns False (and the
    request resumes here) if no peer takes it.
    """
    from shared.messages import AdmitReply, MigrateRequest
    from shared.messages import SamplingParams as WireParams
    from shared.transfer.envelope import TransferTicket

    dec = rt.decode
    req = await dec.freeze(request_id)
    if req is None:
        return True  # finished or cancelled meanwhile: nothing left to move
    seq = req.seq
    p = seq.params
    msg = MigrateRequest(
        request_id=request_id,
        router_id="migrated",
        tokens_subject=req.tokens_subject,
        source_worker_id=rt.cfg.worker_id,
        prompt_len=len(seq.prompt_token_ids),
        num_tokens=seq.num_cached_tokens,
        generated_token_ids=tuple(seq.output_token_ids),
        sampling=WireParams(
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=max(0, p.top_k),
            seed=seq.seed,
            stop_token_ids=tuple(p.stop_token_ids),
            ignore_eos=p.ignore_eos,
            # The peer scores only the prompt rows it still computes; sent ones stay sent.
            logprobs=p.logprobs,
            prompt_logprobs=p.prompt_logprobs,
        ),
        rng_offset=len(seq.output_token_ids),
    )
    for peer in peers:
        try:
            reply = await rt.bus.request(rt.subjects.worker_migrate(peer), msg, AdmitReply, 2.0)
        except Exception:
            continue
        if not reply.ok:
            continue
        ticket = TransferTicket.decode(reply.ticket, rt.secret)
        table = rt.engine.block_manager.block_table(request_id)[: ticket.num_blocks]
        try:
            await rt.sender.send(
                ticket,
                rt.engine.arena,
                table,
                timeout_s=rt.cfg.transfer_timeout_s,
                meta={"migrated_cached_tokens": seq.num_cached_tokens},
            )
        except Exception as exc:
            log.warning("migration_failed", request_id=request_id, peer=peer, error=str(exc))
            continue
        dec.migrated(req, peer)
        log.info(
            "request_migrated", request_id=request_id, peer=peer, kv_tokens=seq.num_cached_tokens
        )
        return True
    dec.unfreeze(req)
    return False
