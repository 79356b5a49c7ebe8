"""Least-privilege NATS users: who may publish and subscribe to what, and the nats-server
``authorization`` block that enforces it.

Every permission is derived from the one table of message flows, ``FLOWS`` in
``shared/messages/subjects.py``: each flow names the kinds that publish and subscribe to
its subjects, with their id scope. Nothing is allowed that no flow uses. Users:

* ``router``, ``controller``: one user per kind (they are few and named in advance).
* ``worker-<id>``: one user per worker, never shared. Where a flow says OWN it may name
  only its own id (tokens, telemetry, events, its registry record, its request subjects);
  receivers also drop stream messages whose ``publisher_id`` differs from the id in the
  subject (``Subjects.publisher_of``). There is no kind-wide worker user.
* ``operator``: everything (``fluidpd ctl``, the NATS CLI, benchmarks, tests).

Replies: a kind that subscribes to a request/reply flow gets ``allow_responses`` (it may
answer the requests it receives, nothing else on an inbox); a kind that publishes to one,
or reads the registry (JetStream API requests), reads replies only on its own inbox
``_INBOX_<user>.>`` (``BusConfig`` uses that prefix for a client with a user), so no user
reads another's replies. Nobody but the operator may delete or reconfigure the registry.
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.bus.config import inbox_prefix_for
from shared.messages.subjects import (
    CONTROLLER,
    FLOWS,
    OPERATOR,
    OWN,
    ROUTER,
    WILDCARD,
    WORKER,
    Subjects,
    check_id,
)

# Kinds with a user of their own; workers get ``worker-<id>`` users instead of a kind user.
KINDS = (ROUTER, CONTROLLER, OPERATOR)
# The worker ids of docker-compose.yml (deploy/compose.cpu.yml uses p0 and d0 of them):
# deploy/nats/auth.conf has one user for each (``python -m services.common.nats_auth
# --workers ...`` writes it for other ids, e.g. a second node's).
COMPOSE_WORKER_IDS = ("p0", "p1", "p2", "p3", "d0", "d1", "d2", "d3")


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


def user_name(kind: str, worker_id: str = WILDCARD) -> str:
    """The NATS user of a kind: the kind itself, or ``worker-<id>`` for a worker."""
    return worker_user(worker_id) if kind == WORKER else kind


def _scoped(scope: str, own: str) -> str:
    return own if scope == OWN else WILDCARD


def permissions(kind: str, subjects: Subjects, worker_id: str = WILDCARD) -> Permissions:
    """The permissions of one user, read off ``FLOWS``: a router, the controller, the
    operator, or worker ``worker_id``. Pure. Raises ValueError for an unknown kind, a
    worker without its own id, or a bad id."""
    if kind == OPERATOR:
        return Permissions(publish=(">",), subscribe=(">",), allow_responses=True)
    if kind not in (ROUTER, CONTROLLER, WORKER):
        raise ValueError(
            f"unknown NATS user kind {kind!r} (one of router, controller, worker, operator)"
        )
    if kind == WORKER and worker_id == WILDCARD:
        raise ValueError("a worker user needs its own worker id: there is no kind-wide worker user")
    own = check_id(worker_id, "worker id") if kind == WORKER else WILDCARD
    publish: list[str] = []
    subscribe: list[str] = []
    requests = answers = False
    for flow in FLOWS:
        for who, scope in flow.publish:
            if who == kind:
                publish += flow.subjects(subjects, _scoped(scope, own))
                requests = requests or flow.reply
        for who, scope in flow.subscribe:
            if who == kind:
                subscribe += flow.subjects(subjects, _scoped(scope, own))
                answers = answers or flow.reply
    if requests:  # replies to its requests (and JetStream's to its API calls) on its inbox
        subscribe.append(inbox_prefix_for(user_name(kind, worker_id)) + ".>")
    return Permissions(
        publish=tuple(dict.fromkeys(publish)),
        subscribe=tuple(dict.fromkeys(subscribe)),
        allow_responses=answers,
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

    def env(self) -> dict[str, str]:
        """The environment a process logs in with (``FLUIDPD_NATS_USER`` /
        ``FLUIDPD_NATS_PASSWORD``: by environment, since argv is visible to every user)."""
        return {"FLUIDPD_NATS_USER": self.name, "FLUIDPD_NATS_PASSWORD": self.password}


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


def password_env(user: str) -> str:
    """The environment variable holding ``user``'s password in a deployment (compose
    passes it from ``.env`` to nats-server and to that process): ``router`` ->
    ``FLUIDPD_NATS_ROUTER_PASSWORD``, ``worker-p0`` -> ``FLUIDPD_NATS_WORKER_P0_PASSWORD``."""
    return f"FLUIDPD_NATS_{re.sub(r'[^A-Za-z0-9]', '_', user).upper()}_PASSWORD"


def render_deploy_authorization(
    subjects: Subjects, worker_ids: tuple[str, ...] = COMPOSE_WORKER_IDS
) -> str:
    """nats-server config text: the router, controller and operator users and one
    ``worker-<id>`` user per worker id, passwords read by nats-server from its environment
    (``password_env``; it refuses to start when one is unset). deploy/nats/auth.conf is
    this text for ``COMPOSE_WORKER_IDS`` (tests/test_deploy.py keeps them equal). Pure.
    Raises ValueError for a bad worker id."""
    users = [(kind, permissions(kind, subjects)) for kind in (ROUTER, CONTROLLER)]
    users += [(worker_user(w), permissions(WORKER, subjects, w)) for w in worker_ids]
    users.append((OPERATOR, permissions(OPERATOR, subjects)))
    ids = ",".join(worker_ids)
    lines = [
        "# GENERATED from the flow table in shared/messages/subjects.py by",
        f"#   python -m services.common.nats_auth --workers {ids} > deploy/nats/auth.conf",
        "# do not edit (tests/test_deploy.py checks it). One least-privilege user per process",
        "# kind and one per worker; docs/subjects.md says who may publish and subscribe to what.",
        "authorization {",
        "  users = [",
    ]
    for name, perms in users:
        lines.append(f"    {{user: {name}, password: ${password_env(name)}, permissions: {{")
        lines.append(f"      publish: {{allow: {json.dumps(list(perms.publish))}}}")
        lines.append(f"      subscribe: {{allow: {json.dumps(list(perms.subscribe))}}}")
        if perms.allow_responses:
            lines.append("      allow_responses: true")
        lines.append("    }}")
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Print deploy/nats/auth.conf for the given worker ids (default: compose's eight)."""
    parser = argparse.ArgumentParser(
        prog="python -m services.common.nats_auth",
        description="Print the nats-server authorization block of a deployment.",
    )
    parser.add_argument(
        "--workers",
        default=",".join(COMPOSE_WORKER_IDS),
        help="comma-separated worker ids, one NATS user each (default: %(default)s)",
    )
    parser.add_argument("--subject-prefix", default="fluidpd")
    args = parser.parse_args(argv)
    ids = tuple(w.strip() for w in args.workers.split(",") if w.strip())
    print(render_deploy_authorization(Subjects(args.subject_prefix), ids), end="")


if __name__ == "__main__":
    main()
