"""Every NATS subject of FluidPD. No subject string is spelled anywhere else.

Subjects are ``<prefix>.<...>``; the prefix (default ``fluidpd``) lets several clusters
share one NATS server. Ids (worker, router) are single subject tokens: letters, digits,
``_`` and ``-``; ``"*"`` is accepted as an id to build a subscription wildcard.
docs/subjects.md describes each subject (direction, payload, rate, CLI examples).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shared.messages.common import ROLES

_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")
WILDCARD = "*"

# verbs of worker.<id>.<verb>
WORKER_VERBS = ("prefill", "admit", "handoff", "cancel", "switch", "migrate")


def check_id(value: str, what: str = "id") -> str:
    """Return ``value`` if it is a valid subject token (or ``*``); raise ValueError."""
    if value != WILDCARD and not _ID_RE.match(value):
        raise ValueError(f"invalid {what} {value!r}: use letters, digits, '_' or '-'")
    return value


@dataclass(frozen=True)
class Subjects:
    """Subject names under one prefix. Immutable; methods are pure."""

    prefix: str = "fluidpd"

    def __post_init__(self) -> None:
        if not _PREFIX_RE.match(self.prefix):
            raise ValueError(f"invalid subject prefix {self.prefix!r}")

    def _worker(self, worker_id: str, verb: str) -> str:
        return f"{self.prefix}.worker.{check_id(worker_id, 'worker id')}.{verb}"

    # --- requests to one worker -------------------------------------------------------
    def worker_prefill(self, worker_id: str) -> str:
        return self._worker(worker_id, "prefill")

    def worker_admit(self, worker_id: str) -> str:
        return self._worker(worker_id, "admit")

    def worker_handoff(self, worker_id: str) -> str:
        return self._worker(worker_id, "handoff")

    def worker_cancel(self, worker_id: str) -> str:
        return self._worker(worker_id, "cancel")

    def worker_switch(self, worker_id: str) -> str:
        return self._worker(worker_id, "switch")

    def worker_migrate(self, worker_id: str) -> str:
        return self._worker(worker_id, "migrate")

    # --- streams ------------------------------------------------------------------------
    def router_tokens(self, router_id: str) -> str:
        """The router's token address, carried in requests (``tokens_subject``). Workers
        publish under it with their own id appended (``tokens_from``), so NATS permissions
        authenticate who sent a batch."""
        return f"{self.prefix}.router.{check_id(router_id, 'router id')}.tokens"

    def tokens_from(self, tokens_subject: str, worker_id: str) -> str:
        """Where worker ``worker_id`` publishes batches for ``tokens_subject`` (a
        ``router_tokens`` address). Raises ValueError for anything else."""
        parts = tokens_subject[len(self.prefix) + 1 :].split(".")
        if not tokens_subject.startswith(self.prefix + ".") or len(parts) != 3:
            raise ValueError(f"not a token address: {tokens_subject!r}")
        if parts[0] != "router" or parts[2] != "tokens" or parts[1] == WILDCARD:
            raise ValueError(f"not a token address: {tokens_subject!r}")
        return self.router_tokens_from(parts[1], worker_id)

    def router_tokens_from(self, router_id: str, worker_id: str) -> str:
        """Token batches from worker ``worker_id`` to router ``router_id`` (either may be
        ``*``, for subscriptions and permissions)."""
        return f"{self.router_tokens(router_id)}.{check_id(worker_id, 'worker id')}"

    def router_tokens_in(self, router_id: str) -> str:
        """The router's subscription: its token address from every worker."""
        return self.router_tokens_from(router_id, WILDCARD)

    def publisher_of(self, subject: str) -> str | None:
        """The worker id a stream subject names as its publisher (token, telemetry and
        event subjects), else None. NATS permissions let a worker publish only under its
        own id, so receivers drop messages whose ``publisher_id`` differs. Pure."""
        head = self.prefix + "."
        if not subject.startswith(head):
            return None
        match subject[len(head) :].split("."):
            case ["router", _, "tokens", worker_id]:
                return worker_id
            case ["telemetry", _, worker_id] | ["events", worker_id]:
                return worker_id
        return None

    def telemetry(self, role: str, worker_id: str) -> str:
        if role != WILDCARD and role not in ROLES:
            raise ValueError(f"invalid role {role!r}")
        return f"{self.prefix}.telemetry.{role}.{check_id(worker_id, 'worker id')}"

    def telemetry_all(self) -> str:
        """Wildcard over every worker's telemetry (both roles)."""
        return f"{self.prefix}.telemetry.>"

    def events(self, worker_id: str) -> str:
        return f"{self.prefix}.events.{check_id(worker_id, 'worker id')}"

    def bench_floor(self, kind: str) -> str:
        """``fluidpd bench serve``'s stack-floor relay (services/bench/serve_floor.py):
        ``requests`` (relay -> stand-in worker) and ``tokens`` (back). Raw bytes, bench only."""
        if kind not in ("requests", "tokens"):
            raise ValueError(f"invalid bench floor subject kind {kind!r}")
        return f"{self.prefix}.bench.floor.{kind}"

    # --- controller ---------------------------------------------------------------------
    def controller_status(self) -> str:
        return f"{self.prefix}.controller.status"

    def controller_policy(self) -> str:
        return f"{self.prefix}.controller.policy"

    def controller_switch_lease(self) -> str:
        return f"{self.prefix}.controller.switch_lease"

    def controller_decisions(self) -> str:
        return f"{self.prefix}.controller.decisions"

    # --- registry -----------------------------------------------------------------------
    def registry_bucket(self) -> str:
        """JetStream KV bucket of worker records (``fluidpd_registry`` by default)."""
        return self.prefix.replace(".", "_") + "_registry"

    def registry_key(self, worker_id: str) -> str:
        """The JetStream subject a put/delete of ``worker_id``'s registry record goes to
        (``*``: any record; for permissions)."""
        return f"$KV.{self.registry_bucket()}.{check_id(worker_id, 'worker id')}"

    # --- metrics labels -----------------------------------------------------------------
    def pattern(self, subject: str) -> str:
        """A bounded-cardinality label for ``subject``: ids replaced by ``*``.

        E.g. ``fluidpd.worker.w3.switch`` → ``worker.*.switch``; unknown → ``other``.
        """
        head = self.prefix + "."
        if not subject.startswith(head):
            return "other"
        parts = subject[len(head) :].split(".")
        match parts:
            case ["worker", _, verb] if verb in WORKER_VERBS:
                return f"worker.*.{verb}"
            case ["router", _, "tokens"] | ["router", _, "tokens", _]:
                return "router.*.tokens"
            case ["telemetry", role, _] if role in ROLES or role == WILDCARD:
                return f"telemetry.{role}.*"
            case ["telemetry", ">"]:
                return "telemetry.>"
            case ["events", _]:
                return "events.*"
            case ["controller", ("status" | "policy" | "decisions" | "switch_lease") as what]:
                return f"controller.{what}"
        return "other"
