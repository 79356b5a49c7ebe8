"""The worker vocabulary, defined once: its ``Role`` and its ``WorkerState``.

The policy layer is the bottom layer, so everything above may import from here: the
messages (shared/messages/common.py re-exports ``Role`` and ``ROLES``), the bus registry,
the services and the simulator. The string values are the wire values; never rename one.

States a worker reports (FluidRole, paper §IV-C2): ``starting`` until its engine and bus are
up, ``active`` while serving its role, ``drain`` while finishing (or migrating) the work of
the role it leaves, ``switch`` while re-slicing its arena for the new role, ``stopping`` on
shutdown, ``failed`` after an engine failure until the process exits
(services/worker/failure.py).
"""

from __future__ import annotations

from typing import Final, Literal, TypeGuard

Role = Literal["prefill", "decode"]
WorkerState = Literal["starting", "active", "drain", "switch", "stopping", "failed"]

PREFILL: Final = "prefill"
DECODE: Final = "decode"
ROLES: Final[tuple[Role, ...]] = (PREFILL, DECODE)

STARTING: Final = "starting"
ACTIVE: Final = "active"
DRAIN: Final = "drain"
SWITCH: Final = "switch"
STOPPING: Final = "stopping"
FAILED: Final = "failed"
WORKER_STATES: Final[tuple[WorkerState, ...]] = (
    STARTING,
    ACTIVE,
    DRAIN,
    SWITCH,
    STOPPING,
    FAILED,
)
# The states FluidRole reasons about (the others are outside the cluster's capacity).
SERVING_STATES: Final[tuple[WorkerState, ...]] = (ACTIVE, DRAIN, SWITCH)


def is_role(value: str) -> TypeGuard[Role]:
    """True when ``value`` names a role (narrows a str from flags, env or JSON to Role)."""
    return value in ROLES


def is_worker_state(value: str) -> TypeGuard[WorkerState]:
    """True when ``value`` is a state a worker reports."""
    return value in WORKER_STATES
