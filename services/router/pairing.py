"""Choosing a (prefill worker, decode worker) pair for a request.

* ``round_robin`` — the paper's baseline (§V: "all evaluated configurations use round-robin
  request routing"): cycles prefill and decode workers independently, ignoring load.
* ``pressure`` (default, our extension; services/router/pressure_pairing.py) — ranks Active
  workers by their telemetry plus the work this router has sent them since.

``make_policy`` (pressure_pairing.py) builds either by name. Only records in state
``active`` are candidates (callers pass them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from shared.messages import WorkerRecord
from shared.policy.roles import DECODE, PREFILL, Role


class NoWorkerError(Exception):
    """No candidate for a role (after exclusions)."""


class PairingPolicy(Protocol):
    name: str

    def choose(
        self,
        prefill: Sequence[WorkerRecord],
        decode: Sequence[WorkerRecord],
        exclude: frozenset[str] = frozenset(),
        *,
        prompt_tokens: int | None = None,
        max_tokens: int | None = None,
        request_id: str | None = None,
    ) -> tuple[str, str]:
        """Return (prefill_worker_id, decode_worker_id). Raises NoWorkerError. The request's
        sizes and id are optional (policies that do not use them ignore them)."""
        ...

    def settle(self, request_id: str) -> None:
        """The request's first token came back (or it ended): see PressurePolicy.choose
        (pressure_pairing.py)."""
        ...

    def withdraw(self, request_id: str) -> None:
        """The pair ``choose`` just returned for ``request_id`` will not be used (the router
        shed the request before sending anything): stop counting it as sent. Called right
        after that ``choose``, before any other."""
        ...


def candidate_ids(
    records: Sequence[WorkerRecord], exclude: frozenset[str], role: Role
) -> list[str]:
    """The sorted ids of ``records`` not in ``exclude`` (all of them when that leaves none).
    Raises NoWorkerError when there are no records. Pure."""
    ids = sorted(r.worker_id for r in records if r.worker_id not in exclude)
    if not ids:
        # Retrying on an excluded worker beats refusing when it is the only one.
        ids = sorted(r.worker_id for r in records)
    if not ids:
        raise NoWorkerError(f"no active {role} worker")
    return ids


class RoundRobinPolicy:
    """Independent cursors over the sorted prefill and decode ids. Mutates its cursors."""

    name = "round_robin"

    def __init__(self) -> None:
        self._cursor: dict[Role, int] = {PREFILL: 0, DECODE: 0}
        self._last: str | None = None  # the request of the latest choice (``withdraw``)

    def pick(self, role: Role, ids: list[str]) -> str:
        i = self._cursor[role]
        self._cursor[role] = i + 1
        return ids[i % len(ids)]

    def claim(self, request_id: str | None) -> None:
        """The decode turn just taken with ``pick`` was ``request_id``'s (None: no decode
        turn, or none to give back): ``withdraw(request_id)`` then gives it back. For a
        caller that takes turns role by role (PressurePolicy's fallback). Mutates."""
        self._last = request_id

    def choose(
        self,
        prefill: Sequence[WorkerRecord],
        decode: Sequence[WorkerRecord],
        exclude: frozenset[str] = frozenset(),
        *,
        prompt_tokens: int | None = None,
        max_tokens: int | None = None,
        request_id: str | None = None,
    ) -> tuple[str, str]:
        p_ids = candidate_ids(prefill, exclude, PREFILL)
        d_ids = candidate_ids(decode, exclude, DECODE)
        self.claim(request_id)
        return self.pick(PREFILL, p_ids), self.pick(DECODE, d_ids)

    def settle(self, request_id: str) -> None:
        """Nothing to settle: round robin ignores load."""

    def withdraw(self, request_id: str) -> None:
        """The prefill turn stays taken: the next request goes to the next prefill worker,
        or one long queue would shed every request after it. The decode turn is given back
        (the decode worker was not used), as in the simulator, which picks it only after
        the door check. Only the latest choice, if it was ``request_id``'s."""
        if request_id == self._last:
            self._cursor[DECODE] -= 1
        self._last = None
