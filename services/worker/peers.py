"""What this worker knows of its peers: the registry's Active workers and the telemetry of
the role it works with (the subscribe half of telemetry).

A prefill worker listens to the decode workers (their steal budgets for Algorithm 1, and
their admission capacity for re-pairing a request that waits, decode_choice.py); a decode
worker listens to the prefill workers (which are alive: it offers each a budget). Times are
this process's monotonic clock: a budget's age is measured from when we received it, so
clock skew between hosts cannot make a budget look fresh. Event loop only.
"""

from __future__ import annotations

import time

from services.worker.decode_choice import DecodeView, pick_with_capacity
from services.worker.prefill.prefill_job import PrefillJob
from shared.bus import Bus, ServeHandle
from shared.bus.registry_watcher import RegistryWatcher
from shared.messages import Subjects, WorkerRecord, WorkerTelemetry
from shared.policy.fluidtoken import StealBudget
from shared.policy.roles import ACTIVE, DECODE, PREFILL, Role

PEER_FRESH_S = 2.0  # a prefill worker unheard of for this long no longer shares budgets


class Peers:
    """Peer views, written only by ``_on_peer`` (the telemetry subscription). Owns the
    subscription (``follow_role``/``stop``); the registry watcher is the runtime's."""

    def __init__(
        self, worker_id: str, bus: Bus, subjects: Subjects, watcher: RegistryWatcher
    ) -> None:
        self.worker_id = worker_id
        self._bus = bus
        self._subjects = subjects
        self._watcher = watcher
        # Prefill side: each decode worker's steal budget for us, and its last word on its
        # admission capacity (re-pairing a request that waits for decode capacity).
        self.budgets: dict[str, StealBudget] = {}
        self.decode_views: dict[str, DecodeView] = {}
        # Decode side: when each prefill worker was last heard of.
        self.prefill_seen_s: dict[str, float] = {}
        self._sub: ServeHandle | None = None
        self._following = ""

    # ------------------------------------------------------------- subscription
    async def follow_role(self, role: Role) -> None:
        """Listen to the telemetry ``role`` uses, and only to it. Idempotent; the role
        switch calls it with the new role. (Each worker used to decode every worker's
        telemetry, its own included: 50 messages a second per worker, half unused.)"""
        if role == self._following:
            return
        if self._sub is not None:
            await self._sub.stop()
        other = DECODE if role == PREFILL else PREFILL
        self._following = role
        self._sub = await self._bus.subscribe_stream(
            self._subjects.telemetry(other, "*"), WorkerTelemetry, self._on_peer
        )

    async def stop(self) -> None:
        """Idempotent."""
        if self._sub is not None:
            await self._sub.stop()
            self._sub = None

    async def _on_peer(self, msg: WorkerTelemetry) -> None:
        if msg.publisher_id == self.worker_id:
            return
        now = time.monotonic()
        if msg.role == PREFILL:
            self.prefill_seen_s[msg.publisher_id] = now
        elif msg.role == DECODE:
            tokens = msg.steal_budgets.get(self.worker_id, 0)
            self.budgets[msg.publisher_id] = StealBudget(float(tokens), now)
            m = msg.metrics
            self.decode_views[msg.publisher_id] = DecodeView(
                now,
                msg.free_blocks,
                msg.running + int(m.get("receiving", 0)),
                int(m.get("decode_waiting", 0)),
                int(m.get("decode_waiting_blocks", 0)),
            )

    def fresh_prefill_peers(self, now_s: float) -> list[str]:
        """Prefill workers heard of within ``PEER_FRESH_S`` (they get a steal budget)."""
        return [p for p, seen in self.prefill_seen_s.items() if now_s - seen < PEER_FRESH_S]

    # ----------------------------------------------------------------- registry
    def active(self, role: Role, exclude: str = "") -> list[WorkerRecord]:
        """Active workers of ``role`` in the registry, other than this one (and ``exclude``)."""
        skip = {self.worker_id, exclude}
        return [
            r for r in self._watcher.workers(role=role, state=ACTIVE) if r.worker_id not in skip
        ]

    def pick_decode_worker(self, current: str) -> str | None:
        """An Active decode worker other than ``current`` (most KV blocks first), or None."""
        candidates = self.active(DECODE, exclude=current)
        if not candidates:
            return None
        return max(candidates, key=lambda r: r.kv_total_blocks).worker_id

    def decode_with_capacity(self, current: str, job: PrefillJob) -> str | None:
        """An Active decode worker other than ``current`` whose telemetry shows room for
        ``job`` now (decode_choice.pick_with_capacity), or None."""
        return pick_with_capacity(
            self.active(DECODE, exclude=current),
            self.decode_views,
            time.monotonic(),
            prompt_tokens=job.prompt_len,
            max_tokens=job.msg.sampling.max_tokens,
        )
