"""Least-privilege NATS users: who may publish and subscribe to what, and the nats-server
``authorization`` block that enforces it.

Every permission is derived from ``shared/messages/subjects.py`` (one definition of the
subjects), so a renamed subject moves its permission with it. One user per service kind:

* ``router``: sends prefill requests and cancels, reads its token streams, telemetry,
  events and the registry. It cannot switch a worker or touch the policy.
* ``controller``: sends switch commands, publishes decisions, answers status/policy
  requests, reads telemetry, events and the registry.
* ``worker``: talks to its peers (prefill hand-over, admit, handoff, cancel, migrate),
  publishes tokens, telemetry, events and its registry record, answers its own requests.
  A *per-worker* user (``worker_id`` given) may publish telemetry, events, tokens and a
  registry record only under its own id, and subscribe only to its own request subjects;
  receivers drop stream messages whose ``publisher_id`` differs from the id in the subject
  (``Subjects.publisher_of``). A worker cannot send switch, policy or status requests.
* ``operator``: everything (``fluidpd ctl``, the NATS CLI, tests).

Replies: responders get ``allow_responses`` (they may answer the requests they receive,
nothing else on an inbox); a requester reads replies only on its own inbox
``_INBOX_<user>.>`` (``BusConfig`` uses that prefix for a client with a user), so no user
reads another's replies. The registry is a
JetStream KV bucket: readers need the bucket's stream-info, consumer and direct-get API
subjects and ``$JS.FC.>`` (flow control of the watch); writers also ``$KV.<bucket>.<key>``.
Nobody but the operator may delete or reconfigure the bucket.
"""

from __future__ import annotations

import json
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.bus.config import inbox_prefix_for
from shared.messages.subjects import WILDCARD, WORKER_VERBS, Subjects, check_id

KINDS = ("router", "controller", "worker", "operator")


@dataclass(frozen=True)
class Permissions:
    """Subjects one user may publish to / subscribe to. Immutable."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False

    def to_server(self) -> dict[str, Any]:
        """The ``permissions`` map of a nats-server user. Pure."""
        out: dict[str, Any] = {
            "publish": {"allow": list(self.publish)},
            "subscribe": {"allow": list(self.subscribe)},
        }
        if self.allow_responses:
            out["allow_responses"] = True
        return out


def _registry(subjects: Subjects, write_key: str | None) -> tuple[str, ...]:
    """JetStream subjects to open, watch (and with ``write_key``, put/delete) the bucket."""
    stream = "KV_" + subjects.registry_bucket()
    api = "$JS.API"
    subs = [
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
    ]
    if write_key is not None:
        subs.append(subjects.registry_key(write_key))
    return tuple(subs)


def user_name(kind: str, worker_id: str = WILDCARD) -> str:
    """The NATS user of a kind: the kind itself, or ``worker-<id>`` for a per-worker user."""
    return kind if worker_id == WILDCARD else worker_user(worker_id)


def permissions(kind: str, subjects: Subjects, worker_id: str = WILDCARD) -> Permissions:
    """The permissions of one service kind (``worker_id`` narrows a worker user to its own
    id). Pure. Raises ValueError for an unknown kind or a bad id."""
    if kind not in KINDS:
        raise ValueError(f"unknown NATS user kind {kind!r} (one of {', '.join(KINDS)})")
    s, any_ = subjects, WILDCARD
    inbox = inbox_prefix_for(user_name(kind, worker_id)) + ".>"
    if kind == "operator":
        return Permissions(publish=(">",), subscribe=(">",), allow_responses=True)
    if kind == "router":
        return Permissions(
            publish=(s.worker_prefill(any_), s.worker_cancel(any_), *_registry(s, None)),
            subscribe=(
                s.router_tokens_in(any_),
                s.telemetry_all(),
                s.events(any_),
                inbox,
            ),
        )
    if kind == "controller":
        return Permissions(
            publish=(s.worker_switch(any_), s.controller_decisions(), *_registry(s, None)),
            subscribe=(
                s.telemetry_all(),
                s.events(any_),
                s.controller_status(),
                s.controller_policy(),
                inbox,
            ),
            allow_responses=True,
        )
    own = check_id(worker_id, "worker id")
    peer_verbs = ("prefill", "admit", "handoff", "cancel", "migrate")
    return Permissions(
        publish=(
            *(getattr(s, f"worker_{verb}")(any_) for verb in peer_verbs),
            s.router_tokens_from(any_, own),
            s.telemetry(any_, own),
            s.events(own),
            *_registry(s, own),
        ),
        subscribe=(
            *(getattr(s, f"worker_{verb}")(own) for verb in WORKER_VERBS),
            s.telemetry_all(),
            s.events(any_),
            inbox,
        ),
        allow_responses=True,
    )


@dataclass(frozen=True)
class NatsUser:
    """One user: name, password (kept out of ``repr``), permissions."""

    name: str
    password: str = field(repr=False)
    permissions: Permissions

    def to_server(self) -> dict[str, Any]:
        return {
            "user": self.name,
            "password": self.password,
            "permissions": self.permissions.to_server(),
        }


def new_password() -> str:
    """A random password (URL-safe: it may appear in a ``nats://user:pass@`` URL)."""
    return secrets.token_urlsafe(24)


def generate_users(subjects: Subjects, worker_ids: tuple[str, ...] = ()) -> dict[str, NatsUser]:
    """Fresh credentials: one user per kind, plus ``worker-<id>`` for each worker id (the
    per-worker users that ``fluidpd up`` hands its workers). Pure apart from randomness."""
    users = {kind: NatsUser(kind, new_password(), permissions(kind, subjects)) for kind in KINDS}
    for worker_id in worker_ids:
        users[worker_user(worker_id)] = worker_user_for(subjects, worker_id)
    return users


def worker_user(worker_id: str) -> str:
    return f"worker-{check_id(worker_id, 'worker id')}"


def worker_user_for(subjects: Subjects, worker_id: str) -> NatsUser:
    """A new per-worker user with fresh credentials."""
    return NatsUser(
        worker_user(worker_id), new_password(), permissions("worker", subjects, worker_id)
    )


def server_config(
    users: dict[str, NatsUser], *, host: str, port: int, store_dir: Path, name: str
) -> dict[str, Any]:
    """A nats-server configuration (JSON is valid nats-server config syntax). Pure."""
    return {
        "server_name": name,
        "host": host,
        "port": port,
        "jetstream": {"store_dir": str(store_dir)},
        "authorization": {"users": [u.to_server() for u in users.values()]},
    }


def write_server_config(path: Path, config: dict[str, Any]) -> Path:
    """Write ``config`` to ``path`` readable by its owner only (it holds passwords).
    Raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.touch(mode=0o600)
    tmp.write_text(json.dumps(config, indent=2), encoding="utf-8")
    tmp.chmod(0o600)
    tmp.replace(path)
    return path


def can_authenticate(
    host: str, port: int, user: str, password: str, timeout_s: float = 2.0
) -> bool:
    """Whether a plain-TCP nats-server accepts ``user``/``password`` now: CONNECT + PING,
    then PONG (yes) or ``-ERR`` / a closed socket (no). Blocking. Raises OSError when the
    server cannot be reached."""
    connect = {"verbose": False, "pedantic": False, "user": user, "pass": password}
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.settimeout(timeout_s)
        buf = b""
        while b"\r\n" not in buf:  # the server's INFO line
            chunk = sock.recv(4096)
            if not chunk:
                return False
            buf += chunk
        sock.sendall(b"CONNECT " + json.dumps(connect).encode() + b"\r\nPING\r\n")
        buf = b""
        while b"\r\n" not in buf:
            try:
                chunk = sock.recv(4096)
            except ConnectionResetError:
                return False
            if not chunk:
                return False
            buf += chunk
        return buf.startswith(b"PONG")


def password_env(kind: str) -> str:
    """The environment variable holding ``kind``'s password in a deployment (compose
    passes it from ``.env`` to nats-server and to the processes of that kind)."""
    return f"FLUIDPD_NATS_{kind.upper()}_PASSWORD"


def render_deploy_authorization(subjects: Subjects) -> str:
    """nats-server config text: one user per kind, passwords read by nats-server from its
    environment (``$FLUIDPD_NATS_<KIND>_PASSWORD``; it refuses to start when one is unset).
    Workers share the kind-wide ``worker`` user here: deployments do not know worker ids in
    advance. deploy/nats/auth.conf is this text (tests/test_deploy.py keeps them equal).
    Pure."""
    lines = [
        "# GENERATED by `python -m services.common.nats_auth` from shared/messages/subjects.py:",
        "# do not edit (tests/test_deploy.py checks it). Least-privilege users of a deployment;",
        "# docs/subjects.md says who may publish and subscribe to what.",
        "authorization {",
        "  users = [",
    ]
    for kind in KINDS:
        perms = permissions(kind, subjects)
        lines.append(f"    {{user: {kind}, password: ${password_env(kind)}, permissions: {{")
        lines.append(f"      publish: {{allow: {json.dumps(list(perms.publish))}}}")
        lines.append(f"      subscribe: {{allow: {json.dumps(list(perms.subscribe))}}}")
        if perms.allow_responses:
            lines.append("      allow_responses: true")
        lines.append("    }}")
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


if __name__ == "__main__":  # regenerate deploy/nats/auth.conf
    print(render_deploy_authorization(Subjects()), end="")
