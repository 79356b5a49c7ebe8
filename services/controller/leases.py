"""Switch leases: the controller is the one place that decides whether a worker may leave
its role, so concurrent switch commands cannot empty a role.

A worker asks for a lease (``fluidpd.controller.switch_lease``) before it accepts any
SwitchCommand, whoever sent it (the controller's own policy, ``fluidpd ctl switch``, a raw
``nats req``). The controller grants it only if at least one *other* worker stays Active in
the source role: Active in the controller's registry view, not holding a lease itself, and
not just switched away from it (a released lease remembers the worker's new role until the
registry shows it). Several switches out of one role may be in flight at once — FluidRole's
sized moves (issue 16) switch k workers together — but every grant counts the ones already
granted, so no interleaving of commands can take the last Active worker of a role.

The worker releases its lease when the switch ends, done or rolled back. A lease of a
worker that left the registry is dropped; one never released expires after ``ttl_s``
(longer than a worker's drain deadline, 60 s). Event loop only.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.messages import WorkerRecord
from shared.policy.roles import ACTIVE

LEASE_TTL_S = 120.0


@dataclass
class _Lease:
    from_role: str
    to_role: str
    expires_s: float


class SwitchLeases:
    """Lease book of one controller. Mutated only by its methods."""

    def __init__(self, ttl_s: float = LEASE_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._leases: dict[str, _Lease] = {}  # worker id -> its switch in flight
        self._moved: dict[str, tuple[str, float]] = {}  # worker -> (role now, until)

    def acquire(
        self,
        worker_id: str,
        from_role: str,
        to_role: str,
        workers: list[WorkerRecord],
        now_s: float,
    ) -> str | None:
        """Grant ``worker_id`` a lease to leave ``from_role`` (None) or say why not
        (the refusal). ``workers``: the registry view. Records the lease when granted."""
        self._expire(now_s)
        if worker_id in self._leases:
            return f"worker {worker_id} is already switching"
        staying = [
            r
            for r in workers
            if r.state == ACTIVE
            and r.worker_id != worker_id
            and r.worker_id not in self._leases
            and self._role_of(r, now_s) == from_role
        ]
        if not staying:
            return f"switch would leave no active {from_role} worker"
        self._leases[worker_id] = _Lease(from_role, to_role, now_s + self.ttl_s)
        return None

    def release(self, worker_id: str, role_now: str, now_s: float) -> None:
        """``worker_id``'s switch ended; it is in ``role_now``. Unknown ids are ignored."""
        self._leases.pop(worker_id, None)
        self._moved[worker_id] = (role_now, now_s + self.ttl_s)

    def forget(self, worker_id: str) -> None:
        """The worker left the registry: drop what it held."""
        self._leases.pop(worker_id, None)
        self._moved.pop(worker_id, None)

    def in_flight(self) -> dict[str, str]:
        """Worker id -> the source role of its switch in flight."""
        return {worker_id: lease.from_role for worker_id, lease in self._leases.items()}

    def _role_of(self, record: WorkerRecord, now_s: float) -> str:
        """The worker's role, trusting a just-released lease over a registry view that
        may not show the switch yet."""
        moved = self._moved.get(record.worker_id)
        if moved is None:
            return record.role
        if moved[0] == record.role or moved[1] < now_s:  # the registry caught up
            del self._moved[record.worker_id]
            return record.role
        return moved[0]

    def _expire(self, now_s: float) -> None:
        for worker_id, lease in list(self._leases.items()):
            if lease.expires_s < now_s:
                del self._leases[worker_id]
