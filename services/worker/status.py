"""A worker's role and state, owned by the runtime and given to the parts that read or change
them (handlers, switcher, telemetry, metrics, the failure path).

Only this object holds them, so "who may change the role" has one answer: the switcher
(``set_role``) and the lifecycle/announcer (``set_state``). Event loop only.
"""

from __future__ import annotations

from shared.policy.roles import ACTIVE, FAILED, STARTING, Role, WorkerState


class WorkerStatus:
    """The current ``role`` and ``state``. Mutated only through ``set_role``/``set_state``."""

    def __init__(self, role: Role) -> None:
        self._role: Role = role
        self._state: WorkerState = STARTING

    @property
    def role(self) -> Role:
        return self._role

    @property
    def state(self) -> WorkerState:
        return self._state

    @property
    def failed(self) -> bool:
        """True once the engine failed: terminal, nothing overrides it."""
        return self._state == FAILED

    def serves(self, role: Role) -> bool:
        """True while Active in ``role`` (what a request of that role needs)."""
        return self._role == role and self._state == ACTIVE

    def set_role(self, role: Role) -> None:
        """The role switch's flip (or its roll-back). Mutates."""
        self._role = role

    def set_state(self, state: WorkerState) -> WorkerState:
        """Enter ``state``; returns the previous one. Mutates (no check: ``failed`` is kept
        terminal by its callers, services/worker/state_events.py)."""
        old, self._state = self._state, state
        return old
