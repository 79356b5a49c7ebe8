"""The one permissions table (``FLOWS`` in shared/messages/subjects.py) under a real
nats-server with the users ``fluidpd up`` generates: every message flow works for the
service kinds the table names, each logged in as its own user, and is refused to every
other user. So nothing is allowed that no flow uses, and no flow lacks a permission
(the lease gap that made every switch under auth fail)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.common.nats_auth import (
    COMPOSE_WORKER_IDS,
    KINDS,
    generate_users,
    permissions,
    render_deploy_authorization,
    user_name,
)
from shared.bus import Bus, BusConfig
from shared.bus.config import inbox_prefix_for
from shared.bus.registry import RegistryConfig, open_bucket
from shared.messages.subjects import (
    ANY,
    CONTROLLER,
    FLOWS,
    OPERATOR,
    OWN,
    ROUTER,
    WORKER,
    Flow,
    Subjects,
)
from tests.support.nats_server import NatsServer

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
S = Subjects()
# The users of the walk: the kinds, and two workers (a sender p0 and a receiver d0).
SENDER, RECEIVER = "p0", "d0"
USERS = (ROUTER, CONTROLLER, f"worker-{SENDER}", f"worker-{RECEIVER}")
# Flows whose subjects JetStream answers (walked through the registry below).
REGISTRY_FLOWS = {"registry", "registry-record"}
# How long a message or a violation report is waited for. Both come back in milliseconds;
# a refused-but-allowed case (a test failure) is the only one that waits it out.
SETTLE_S = 10.0


@dataclass
class Client:
    """One user's connection and the asynchronous errors the server sent it."""

    user: str
    nc: NATS
    errors: list[str] = field(default_factory=list)
    error_seen: asyncio.Event = field(default_factory=asyncio.Event)

    async def violation(self, timeout_s: float = SETTLE_S) -> bool:
        """Whether the server reports a permissions violation within ``timeout_s``."""
        try:
            await asyncio.wait_for(self._wait_violation(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def _wait_violation(self) -> None:
        while not any("permissions violation" in e.lower() for e in self.errors):
            self.error_seen.clear()
            await self.error_seen.wait()

    def clear(self) -> None:
        self.errors.clear()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    users = generate_users(S, (SENDER, RECEIVER))
    srv = NatsServer(tmp_path_factory.mktemp("perm-js"), users=users)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def clients(server: NatsServer) -> AsyncIterator[dict[str, Client]]:
    out: dict[str, Client] = {}
    for user in (*USERS, OPERATOR):
        name, password = server.credentials(user) or ("", "")
        client = Client(user, None)  # type: ignore[arg-type]

        async def on_error(exc: Exception, c: Client = client) -> None:
            c.errors.append(str(exc))
            c.error_seen.set()

        client.nc = await nats.connect(
            server.url,
            user=name,
            password=password,
            inbox_prefix=inbox_prefix_for(name).encode(),
            error_cb=on_error,
            allow_reconnect=False,
        )
        out[user] = client
    try:
        yield out
    finally:
        for c in out.values():
            await c.nc.close()


def _subject_id(flow: Flow) -> str:
    """The worker id in the subject a walk of ``flow`` uses: the receiving worker's where a
    worker subscribes to its own, else the sending worker's."""
    return RECEIVER if (WORKER, OWN) in flow.subscribe else SENDER


def _subject(flow: Flow) -> str:
    return flow.subjects(S, _subject_id(flow))[0]


def _allowed(user: str, grants: tuple[tuple[str, str], ...], subject_id: str) -> bool:
    """Whether the table grants ``user`` a subject naming ``subject_id``."""
    kind, own = (WORKER, user.removeprefix("worker-")) if user.startswith("worker-") else (user, "")
    return any(k == kind and (scope == ANY or own == subject_id) for k, scope in grants)


def _senders(flow: Flow) -> list[str]:
    return [user_name(k, SENDER) for k, _ in flow.publish] or [OPERATOR]


def _receivers(flow: Flow) -> list[str]:
    return [user_name(k, RECEIVER) for k, _ in flow.subscribe] or [OPERATOR]


async def _deliver(
    clients: dict[str, Client], flow: Flow, sender: str, receiver: str, subject: str
) -> bool:
    """Whether ``sender``'s message (a request for a request/reply flow) on ``subject``
    reaches ``receiver`` (and its answer comes back)."""
    got: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        await got.put(msg)
        if msg.reply:
            await clients[receiver].nc.publish(msg.reply, b"ok")

    sub = await clients[receiver].nc.subscribe(subject, cb=on_msg)
    await clients[receiver].nc.flush()
    try:
        if flow.reply:
            try:
                reply = await clients[sender].nc.request(subject, b"walk", timeout=SETTLE_S)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                return False
            return reply.data == b"ok" and got.qsize() == 1
        await clients[sender].nc.publish(subject, b"walk")
        await clients[sender].nc.flush()
        try:
            msg = await asyncio.wait_for(got.get(), SETTLE_S)
        except TimeoutError:
            return False
        return msg.data == b"walk"
    finally:
        await sub.unsubscribe()


WALKED = [f for f in FLOWS if f.name not in REGISTRY_FLOWS]


@pytest.mark.parametrize("flow", WALKED, ids=[f.name for f in WALKED])
async def test_every_flow_works_for_the_kinds_it_names(
    clients: dict[str, Client], flow: Flow
) -> None:
    subject = _subject(flow)
    for sender in _senders(flow):
        for receiver in _receivers(flow):
            # Up to 3 tries: a delivery now and then goes missing under load (cause not
            # found); a refused permission never gets through, so the check stays honest.
            for _ in range(3):
                if ok := await _deliver(clients, flow, sender, receiver, subject):
                    break
            assert ok, f"{flow.name}: {sender} -> {receiver} on {subject}: {clients[sender].errors}"
            assert not clients[sender].errors and not clients[receiver].errors


@pytest.mark.parametrize("flow", WALKED, ids=[f.name for f in WALKED])
async def test_every_flow_is_refused_to_everyone_else(
    clients: dict[str, Client], flow: Flow
) -> None:
    subject, subject_id = _subject(flow), _subject_id(flow)
    for user in USERS:
        c = clients[user]
        if not _allowed(user, flow.publish, subject_id):
            c.clear()
            await c.nc.publish(subject, b"forged")
            await c.nc.flush()
            assert await c.violation(), f"{user} may publish {flow.name} ({subject})"
        if not _allowed(user, flow.subscribe, subject_id):
            c.clear()
            sub = await c.nc.subscribe(subject)
            await c.nc.flush()
            assert await c.violation(), f"{user} may subscribe to {flow.name} ({subject})"
            await sub.unsubscribe()
        c.clear()


async def test_a_worker_speaks_only_under_its_own_id(clients: dict[str, Client]) -> None:
    """OWN flows: worker-p0 can neither publish as d0 nor listen to d0's requests."""
    p0 = clients[f"worker-{SENDER}"]
    for flow in FLOWS:
        for kind, scope in flow.publish:
            if (kind, scope) == (WORKER, OWN) and flow.name not in REGISTRY_FLOWS:
                p0.clear()
                await p0.nc.publish(flow.subjects(S, RECEIVER)[0], b"forged")
                await p0.nc.flush()
                assert await p0.violation(), f"p0 published {flow.name} as {RECEIVER}"
        for kind, scope in flow.subscribe:
            if (kind, scope) == (WORKER, OWN):
                p0.clear()
                sub = await p0.nc.subscribe(flow.subjects(S, RECEIVER)[0])
                await p0.nc.flush()
                assert await p0.violation(), f"p0 listened to {RECEIVER}'s {flow.name}"
                await sub.unsubscribe()
    p0.clear()


async def test_no_user_reads_another_users_replies(clients: dict[str, Client]) -> None:
    router = clients[ROUTER]
    router.clear()
    sub = await router.nc.subscribe(inbox_prefix_for(CONTROLLER) + ".>")
    await router.nc.flush()
    assert await router.violation()
    await sub.unsubscribe()
    router.clear()


async def _bus(server: NatsServer, user: str) -> Bus:
    name, password = server.credentials(user) or ("", "")
    bus = Bus(BusConfig(servers=(server.url,), user=name, password=password, name=user), S)
    await bus.start()
    return bus


async def test_registry_flows(server: NatsServer) -> None:
    """Every kind opens and reads the registry bucket; a worker writes only its own
    record; nobody but the operator deletes the bucket."""
    cfg = RegistryConfig()
    buses = {u: await _bus(server, u) for u in USERS}
    try:
        p0_kv = await open_bucket(buses[f"worker-{SENDER}"], cfg)
        await p0_kv.put(SENDER, b"record")
        with pytest.raises(nats.errors.Error):  # a timeout or a permissions error
            await p0_kv.put(RECEIVER, b"forged")
        for user in (ROUTER, CONTROLLER, f"worker-{RECEIVER}"):
            kv = await open_bucket(buses[user], cfg)
            assert (await kv.get(SENDER)).value == b"record"
            watcher = await kv.watchall()
            entry = await watcher.updates(timeout=5.0)
            assert entry is not None and entry.key == SENDER
            await watcher.stop()
            if user != f"worker-{RECEIVER}":
                with pytest.raises(nats.errors.Error):
                    await kv.put(SENDER, b"forged")
        js = buses[ROUTER].jetstream()
        with pytest.raises(nats.errors.Error):
            await js.delete_stream("KV_" + S.registry_bucket())
    finally:
        for bus in buses.values():
            await bus.stop()


def test_permissions_are_read_off_the_table() -> None:
    """Each user's allow lists are exactly the subjects of the flows that name its kind
    (plus its inbox): a permission no flow uses cannot appear."""
    for kind, wid in ((ROUTER, "*"), (CONTROLLER, "*"), (WORKER, SENDER)):
        perms = permissions(kind, S, wid)
        own = wid if kind == WORKER else "*"
        pub = {
            subject
            for f in FLOWS
            for k, scope in f.publish
            if k == kind
            for subject in f.subjects(S, own if scope == OWN else "*")
        }
        sub = {
            subject
            for f in FLOWS
            for k, scope in f.subscribe
            if k == kind
            for subject in f.subjects(S, own if scope == OWN else "*")
        }
        assert set(perms.publish) == pub
        assert set(perms.subscribe) - sub == {inbox_prefix_for(user_name(kind, wid)) + ".>"}
    assert KINDS == (ROUTER, CONTROLLER, OPERATOR)  # no kind-wide worker user
    with pytest.raises(ValueError):
        permissions(WORKER, S)
    assert all(scope in (ANY, OWN) for f in FLOWS for _, scope in (*f.publish, *f.subscribe))


def test_committed_auth_conf_is_generated_from_the_table() -> None:
    conf = Path(__file__).resolve().parents[1] / "deploy" / "nats" / "auth.conf"
    assert conf.read_text() == render_deploy_authorization(S, COMPOSE_WORKER_IDS)
