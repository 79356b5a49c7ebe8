"""The worker's side of the controller's switch leases (services/controller/leases.py).

Before a worker accepts any SwitchCommand it asks the controller for a lease; the
controller refuses a second switch out of the same role and a switch that would leave the
role without an Active worker, so concurrent commands (whoever sends them) cannot empty a
role. The lease is released when the switch ends.

Without a controller (nobody answers the lease subject: a bare set of workers, as in some
tests and benchmarks) the worker falls back to its own registry view, with a warning;
that view cannot see a concurrent switch of another worker. A controller that exists but
does not answer in time makes the worker refuse the switch (retry later).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import structlog

from shared.bus import Bus
from shared.bus.errors import BusNoRespondersError
from shared.messages import Role, Subjects, SwitchLeaseReply, SwitchLeaseRequest, WorkerRecord

log = structlog.get_logger(__name__)

_LEASE_TIMEOUT_S = 2.0


class SwitchLease:
    """At most one lease held at a time (the switcher runs one switch at a time)."""

    def __init__(
        self,
        worker_id: str,
        bus: Bus,
        subjects: Subjects,
        active_peers: Callable[[Role], Sequence[WorkerRecord]],
    ) -> None:
        """``active_peers(role)``: the other Active workers of ``role`` (the fallback
        without a controller)."""
        self.worker_id = worker_id
        self._bus = bus
        self._subjects = subjects
        self._active_peers = active_peers
        self.held = False

    def _request(self, from_role: Role, to_role: Role, release: bool) -> SwitchLeaseRequest:
        return SwitchLeaseRequest(
            worker_id=self.worker_id, from_role=from_role, to_role=to_role, release=release
        )

    async def acquire(self, from_role: Role, to_role: Role) -> str | None:
        """None when this worker may leave ``from_role`` (lease held, or no controller and
        the local view allows it); otherwise why not. Never raises."""
        try:
            reply = await self._bus.request(
                self._subjects.controller_switch_lease(),
                self._request(from_role, to_role, False),
                SwitchLeaseReply,
                _LEASE_TIMEOUT_S,
            )
        except BusNoRespondersError:
            log.warning("switch_without_controller", worker_id=self.worker_id)
            if not self._active_peers(from_role):
                return f"switch would leave no active {from_role} worker"
            return None
        except Exception as exc:
            return f"the controller did not grant a switch lease ({type(exc).__name__}); retry"
        if not reply.ok:
            return reply.error or "the controller refused the switch"
        self.held = True
        return None

    async def release(self, role_now: Role) -> None:
        """End the lease (the switch is over; the worker is in ``role_now``). Never raises:
        an unreleased lease expires at the controller."""
        if not self.held:
            return
        self.held = False
        try:
            await self._bus.request(
                self._subjects.controller_switch_lease(),
                self._request(role_now, role_now, True),
                SwitchLeaseReply,
                _LEASE_TIMEOUT_S,
            )
        except Exception as exc:
            log.warning(
                "switch_lease_release_failed", worker_id=self.worker_id, error=type(exc).__name__
            )
