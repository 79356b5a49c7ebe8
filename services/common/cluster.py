"""A whole local FluidPD cluster as child processes: nats-server, controller, router, workers.

Used by ``fluidpd up``, the end-to-end tests and the benchmarks::

    cluster = Cluster(ClusterSpec(prefill=1, decode=1, model="tiny", port=0))
    try:
        cluster.start()
        cluster.wait_ready(timeout_s=120)
        ... cluster.router_url, cluster.nats_url ...
        cluster.kill_worker("d0", signal.SIGKILL)
    finally:
        cluster.stop()

Blocking API (call it from a thread, e.g. ``asyncio.to_thread``, inside async code).
Every child runs in its own process group; ``stop()`` ends them all (SIGTERM, grace,
SIGKILL) and nats-server last, so workers can deregister on the way out. What to start is a
``ClusterSpec`` (cluster_spec.py); each child's command line comes from cluster_commands.py.

Ports: the private nats-server and, with ``spec.port == 0``, the router bind a port of the
kernel's choice themselves and the cluster reads it back from their logs (nats-server's
listening line, the router's ready line). Picking a free port here and handing it to the
child would be a race that a loaded machine loses (another process binds it first).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import signal
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from services.common.cluster_commands import (
    CONTROLLER_READY,
    ROUTER_READY,
    WORKER_READY,
    controller_argv,
    router_argv,
    router_url_of,
    worker_argv,
)
from services.common.cluster_spec import ClusterSpec
from services.common.nats_auth import (
    NatsUser,
    can_authenticate,
    generate_users,
    server_config,
    worker_user,
    worker_user_for,
    write_server_config,
)
from services.common.nats_server import READY_LINE, LocalNatsServer, listening_port
from services.common.procs import ChildProcess, LogSink, stop_all
from shared.messages.subjects import Subjects
from shared.policy.roles import Role


class ClusterStartError(RuntimeError):
    """A child exited before the cluster was ready, or readiness timed out."""


class Cluster:
    """The processes of one local cluster. Not reusable after ``stop()``."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.sink = LogSink(terminal=spec.log_to_terminal, log_dir=spec.log_dir)
        self.nats: ChildProcess | None = None
        self.controller: ChildProcess | None = None
        self.router: ChildProcess | None = None
        self.workers: dict[str, ChildProcess] = {}
        self.nats_url = spec.nats_url or ""
        self._store_dir: Path | None = None
        self._event = threading.Event()  # set by any child's ready/exit
        self._secret = secrets.token_hex(16)  # used unless the environment names one
        self._users: dict[str, NatsUser] = {}  # NATS users when spec.nats_auth
        self._nats_server: LocalNatsServer | None = None
        self._stopped = False

    # --- addresses ----------------------------------------------------------------------
    @property
    def router_url(self) -> str:
        """With ``spec.port == 0``, the URL the router reported once ready (before that the
        ``:0`` placeholder, which nothing answers)."""
        if self.spec.port == 0 and self.router is not None and self.router.ready_line:
            url = router_url_of(self.router.ready_line)
            if url:
                return url
        return f"http://{self.spec.host}:{self.spec.port}"

    def children(self) -> list[ChildProcess]:
        """Every started child, nats-server last."""
        out = [c for c in (self.router, *self.workers.values(), self.controller) if c]
        return out + ([self.nats] if self.nats else [])

    @property
    def operator_credentials(self) -> tuple[str, str] | None:
        """(user, password) of the all-powerful operator user, None without auth."""
        op = self._users.get("operator")
        return (op.name, op.password) if op else None

    @property
    def operator_url(self) -> str:
        """``nats_url`` with the operator's credentials (what ``fluidpd ctl``, benchmarks and
        tests connect as); ``nats_url`` itself without auth."""
        creds = self.operator_credentials
        if creds is None or "://" not in self.nats_url:
            return self.nats_url
        scheme, rest = self.nats_url.split("://", 1)
        return f"{scheme}://{creds[0]}:{creds[1]}@{rest}"

    def pids(self) -> dict[str, int]:
        return {c.name: c.pid for c in self.children() if c.pid is not None}

    # --- start --------------------------------------------------------------------------
    def _child(
        self,
        name: str,
        argv: list[str],
        marker: str | None,
        cpus: tuple[int, ...] = (),
        nats_user: str | None = None,
    ) -> ChildProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **dict(self.spec.env)}
        env.setdefault("FLUIDPD_CLUSTER_SECRET", self._secret)  # one secret for all
        user = self._users.get(nats_user or "")
        if user is not None:  # by environment: argv is visible to every local user
            env.update(user.env())
        child = ChildProcess(
            name,
            argv,
            env=env,
            ready_marker=marker,
            sink=self.sink,
            die_with_parent=self.spec.die_with_parent,
            cpus=cpus,
            on_event=self._event,
        )
        child.start()
        return child

    def _start_nats(self, deadline_s: float) -> None:
        self._store_dir = Path(tempfile.mkdtemp(prefix="fluidpd-nats-"))
        server = LocalNatsServer.on_random_port(self._store_dir)
        if self.spec.nats_auth and not self.spec.nats_url:
            ids = tuple(worker_id for worker_id, _ in self.spec.worker_ids())
            self._users = generate_users(Subjects(), ids)
            server = dataclasses.replace(server, config_file=self._store_dir / "nats.conf")
            self._nats_server = server
            self._write_nats_config()
        # "Server is ready" goes to stderr, merged into the pumped stdout.
        self.nats = self._child("nats", server.argv(), READY_LINE, self.spec.control_cpus)
        self._wait_for([self.nats], deadline_s)
        port = listening_port(self.nats.tail())
        if port is None:
            raise ClusterStartError(f"nats-server did not log its port:\n{self.nats.tail(10)}")
        server = dataclasses.replace(server, port=port)
        self.nats_url = server.url
        if self._nats_server is not None:  # a reload rewrites the config with the real port
            self._nats_server = server

    def start(self, nats_timeout_s: float = 20.0) -> None:
        """Start nats-server (unless given), controller, workers and router. Returns once
        spawned (nats-server already accepting clients); see ``wait_ready``.

        Raises ClusterStartError, NatsServerNotFoundError or OSError."""
        spec = self.spec
        if not spec.nats_url:
            self._start_nats(time.monotonic() + nats_timeout_s)
        if spec.with_controller:
            self.controller = self._child(
                "controller",
                controller_argv(spec, self.nats_url),
                CONTROLLER_READY,
                spec.control_cpus,
                nats_user="controller",
            )
        for worker_id, role in spec.worker_ids():
            self.add_worker(worker_id, role)
        if spec.with_router:
            self.router = self._child(
                "router",
                router_argv(spec, self.nats_url),
                ROUTER_READY,
                spec.control_cpus,
                nats_user="router",
            )

    def worker_env(self, worker_id: str) -> dict[str, str]:
        """The NATS credentials of worker ``worker_id`` as environment variables (empty
        without auth), creating its user first if it is new (nats-server reloads). For a
        worker started outside ``add_worker`` (a test's odd one out). Raises
        ClusterStartError when nats-server does not take the new user."""
        if not self._users:
            return {}
        user = worker_user(worker_id)
        if user not in self._users:  # a replacement with a new id: tell nats-server
            self._users[user] = worker_user_for(Subjects(), worker_id)
            self._reload_nats()
        return self._users[user].env()

    def add_worker(
        self, worker_id: str, role: Role, extra_args: tuple[str, ...] = ()
    ) -> ChildProcess:
        """Spawn one worker with the spec's flags (``Cluster.start`` uses it for every
        worker; tests use it to add a replacement). Returns at once, without waiting for
        readiness; ``stop()`` stops it too. Mutates ``self.workers`` (and, with NATS auth,
        adds the worker's user to nats-server first, by a config reload). Raises OSError, or
        ClusterStartError when nats-server does not take the new user. ``extra_args`` follow the
        spec's worker flags on this worker's command line."""
        user = worker_user(worker_id) if self.worker_env(worker_id) else None
        argv = [*worker_argv(self.spec, worker_id, role, self.nats_url), *extra_args]
        child = self._child(worker_id, argv, WORKER_READY, self.spec.worker_cpus, user)
        self.workers[worker_id] = child
        return child

    def _write_nats_config(self) -> None:
        server = self._nats_server
        assert server is not None and server.config_file is not None
        doc = server_config(
            self._users,
            host=server.host,
            port=server.port_arg,
            store_dir=server.store_dir,
            name=server.name,
        )
        write_server_config(server.config_file, doc)

    def _reload_nats(self, timeout_s: float = 10.0) -> None:
        """Rewrite the users and make nats-server reload them (SIGHUP); returns once the
        newest user can log in. Raises ClusterStartError."""
        server, newest = self._nats_server, list(self._users.values())[-1]
        if self.nats is None or server is None:
            return
        self._write_nats_config()
        self.nats.signal(signal.SIGHUP)
        deadline_s = time.monotonic() + timeout_s
        while not can_authenticate(server.host, server.port, newest.name, newest.password):
            if time.monotonic() > deadline_s or self.nats.exited.is_set():
                raise ClusterStartError(
                    f"nats-server did not reload its users:\n{self.nats.tail(10)}"
                )
            time.sleep(0.05)  # a reload has no event to wait on: poll the login itself

    # --- readiness ----------------------------------------------------------------------
    def _wait_for(
        self, children: list[ChildProcess], deadline_s: float, cancel: threading.Event | None = None
    ) -> None:
        while True:
            self._event.clear()
            for child in children:
                if child.exited.is_set():
                    raise ClusterStartError(
                        f"{child.name} exited with status {child.wait(1.0)} during start-up; "
                        f"its last log lines:\n{child.tail(30)}"
                    )
            waiting = [c.name for c in children if not c.ready.is_set()]
            if not waiting:
                return
            if cancel is not None and cancel.is_set():
                raise ClusterStartError("start-up cancelled")
            remaining_s = deadline_s - time.monotonic()
            if remaining_s <= 0:
                tails = "\n".join(f"--- {n} ---\n{self._by_name(n).tail(10)}" for n in waiting)
                raise ClusterStartError(f"not ready in time: {', '.join(waiting)}\n{tails}")
            # Wake on any child's ready/exit, or on cancel (checked at least every 0.2 s).
            self._event.wait(min(remaining_s, 0.2))

    def _by_name(self, name: str) -> ChildProcess:
        return next(c for c in self.children() if c.name == name)

    def wait_ready(self, timeout_s: float = 300.0, cancel: threading.Event | None = None) -> None:
        """Block until every child logged its ready line and the router's /health is 200.

        Raises ClusterStartError (a child exited early — with its last log lines — or the
        deadline passed, or ``cancel`` was set)."""
        deadline_s = time.monotonic() + timeout_s
        self._wait_for([c for c in self.children() if c is not self.nats], deadline_s, cancel)
        if self.router is None:
            return
        while True:  # the router said it listens; /health also needs workers registered
            if self.health_ok():
                return
            self._wait_for([c for c in self.children() if c is not self.nats], deadline_s, cancel)
            if time.monotonic() >= deadline_s:
                raise ClusterStartError(f"router {self.router_url}/health never returned 200")
            if cancel is not None and cancel.wait(0.1):
                raise ClusterStartError("start-up cancelled")
            if cancel is None:
                time.sleep(0.1)  # polling an HTTP endpoint: there is no event to wait on

    def health_ok(self, timeout_s: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(self.router_url + "/health", timeout=timeout_s) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def exited_children(self) -> list[ChildProcess]:
        """Children whose process has ended (for supervision)."""
        return [c for c in self.children() if c.exited.is_set()]

    # --- operations ---------------------------------------------------------------------
    def kill_worker(self, worker_id: str, sig: int) -> None:
        """Send ``sig`` to worker ``worker_id``'s process group. Raises KeyError."""
        self.workers[worker_id].signal(sig)

    def stop(self) -> dict[str, int | None]:
        """Stop router, workers and controller together, then nats-server; remove the
        temporary JetStream store. Idempotent. Returns name → exit status."""
        if self._stopped:
            return {}
        self._stopped = True
        services = [c for c in self.children() if c is not self.nats]
        results = stop_all(services, self.spec.stop_grace_s)
        if self.nats is not None:
            results["nats"] = self.nats.stop(5.0)
        if self._store_dir is not None:
            shutil.rmtree(self._store_dir, ignore_errors=True)
        return results
