"""Every NATS subject of FluidPD. No subject string is spelled anywhere else.

Subjects are ``<prefix>.<...>``; the prefix (default ``fluidpd``) lets several clusters
share one NATS server. Ids (worker, router) are single subject tokens: letters, digits,
``_`` and ``-``; ``"*"`` is accepted as an id to build a subscription wildcard.
docs/subjects.md describes each subject (direction, payload, rate, CLI examples).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from shared.messages.common import ROLES

_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")
WILDCARD = "*"

# verbs of worker.<id>.<verb>
WORKER_VERBS = ("prefill", "admit", "cancel", "switch", "migrate")


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
        """Wildcard over every worker's telemetry (both roles): ``telemetry.*.*``, the
        subscription and the permission are the same pattern."""
        return self.telemetry(WILDCARD, WILDCARD)

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

    def registry_api(self) -> tuple[str, ...]:
        """The JetStream API subjects a client publishes to open and watch the registry
        bucket (stream info/create, consumers, direct get) and ``$JS.FC.>``, the watch's
        flow control. Replies come on the client's inbox. Nothing here deletes or
        reconfigures the bucket."""
        stream = "KV_" + self.registry_bucket()
        api = "$JS.API"
        return (
            f"{api}.INFO",
            f"{api}.STREAM.INFO.{stream}",
            f"{api}.STREAM.CREATE.{stream}",  # the first worker or watcher creates it
            f"{api}.CONSUMER.CREATE.{stream}",
            f"{api}.CONSUMER.CREATE.{stream}.>",
            f"{api}.CONSUMER.DELETE.{stream}.>",
            f"{api}.CONSUMER.INFO.{stream}.>",
            f"{api}.STREAM.MSG.GET.{stream}",
            f"{api}.DIRECT.GET.{stream}",
            f"{api}.DIRECT.GET.{stream}.>",
            "$JS.FC.>",
        )

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
            case ["events", _]:
                return "events.*"
            case ["controller", ("status" | "policy" | "decisions" | "switch_lease") as what]:
                return f"controller.{what}"
        return "other"


# --- who may publish and subscribe: the one table -------------------------------------------
# Service kinds with a NATS identity (services/common/nats_auth.py turns this table into
# nats-server users). The operator (``fluidpd ctl``, the NATS CLI, benchmarks) may do
# everything and is not listed per flow.
ROUTER, CONTROLLER, WORKER, OPERATOR = "router", "controller", "worker", "operator"
SERVICE_KINDS = (ROUTER, CONTROLLER, WORKER)
# Which ids a kind may name in a subject's id position: any id, or (a per-worker user
# ``worker-<id>``) only its own.
ANY, OWN = "any", "own"


@dataclass(frozen=True)
class Flow:
    """One message flow: its subjects as a function of a worker id (``*`` for ANY), the
    kinds that publish and subscribe with their id scope, and whether it is request/reply
    (subscribers may answer the requests they receive; publishers read replies on their
    own inbox). No subscriber kind: only the operator listens, or (with ``reply``)
    JetStream itself answers."""

    name: str
    subjects: Callable[[Subjects, str], tuple[str, ...]]
    publish: tuple[tuple[str, str], ...] = ()
    subscribe: tuple[tuple[str, str], ...] = ()
    reply: bool = False


FLOWS: tuple[Flow, ...] = (
    # router -> prefill worker (a request), worker -> worker (a switch hands its queue over)
    Flow(
        "prefill",
        lambda s, w: (s.worker_prefill(w),),
        publish=((ROUTER, ANY), (WORKER, ANY)),
        subscribe=((WORKER, OWN),),
        reply=True,
    ),
    # prefill worker -> its decode worker: reserve KV blocks
    Flow(
        "admit",
        lambda s, w: (s.worker_admit(w),),
        publish=((WORKER, ANY),),
        subscribe=((WORKER, OWN),),
        reply=True,
    ),
    # router or a peer worker -> any worker: stop a request, free its blocks
    Flow(
        "cancel",
        lambda s, w: (s.worker_cancel(w),),
        publish=((ROUTER, ANY), (WORKER, ANY)),
        subscribe=((WORKER, OWN),),
    ),
    # draining decode worker -> peer: take over a running decode
    Flow(
        "migrate",
        lambda s, w: (s.worker_migrate(w),),
        publish=((WORKER, ANY),),
        subscribe=((WORKER, OWN),),
        reply=True,
    ),
    # controller (FluidRole) -> worker: change role
    Flow(
        "switch",
        lambda s, w: (s.worker_switch(w),),
        publish=((CONTROLLER, ANY),),
        subscribe=((WORKER, OWN),),
        reply=True,
    ),
    # worker -> controller: one switch at a time, never empty a role
    Flow(
        "lease",
        lambda s, w: (s.controller_switch_lease(),),
        publish=((WORKER, ANY),),
        subscribe=((CONTROLLER, ANY),),
        reply=True,
    ),
    # worker -> router: token batches, under the publishing worker's id
    Flow(
        "tokens",
        lambda s, w: (s.router_tokens_from(WILDCARD, w),),
        publish=((WORKER, OWN),),
        subscribe=((ROUTER, ANY),),
    ),
    # worker -> everyone: PPI/DPI, steal budgets, queue work (router door, controller,
    # peers' Algorithm 1)
    Flow(
        "telemetry",
        lambda s, w: (s.telemetry(WILDCARD, w),),
        publish=((WORKER, OWN),),
        subscribe=((ROUTER, ANY), (CONTROLLER, ANY), (WORKER, ANY)),
    ),
    # worker -> operators: role/state changes (bench shift, the NATS CLI)
    Flow("events", lambda s, w: (s.events(w),), publish=((WORKER, OWN),)),
    # controller -> operators: every FluidRole decision with its inputs
    Flow("decisions", lambda s, w: (s.controller_decisions(),), publish=((CONTROLLER, ANY),)),
    # operator -> controller (fluidpd ctl status / policy pause|resume)
    Flow(
        "status",
        lambda s, w: (s.controller_status(),),
        subscribe=((CONTROLLER, ANY),),
        reply=True,
    ),
    Flow(
        "policy",
        lambda s, w: (s.controller_policy(),),
        subscribe=((CONTROLLER, ANY),),
        reply=True,
    ),
    # everyone reads the registry bucket; a worker writes its own record
    Flow(
        "registry",
        lambda s, w: s.registry_api(),
        publish=((ROUTER, ANY), (CONTROLLER, ANY), (WORKER, ANY)),
        reply=True,
    ),
    Flow(
        "registry-record",
        lambda s, w: (s.registry_key(w),),
        publish=((WORKER, OWN),),
        reply=True,
    ),
)
