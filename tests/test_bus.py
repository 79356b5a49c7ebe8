"""The bus wrapper against a real nats-server: request/reply (msgpack and JSON), error
replies, streams with sequence tracking, metrics, auth, and the raw wire client."""

from __future__ import annotations

import asyncio
import json
import os

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from shared.bus import (
    Bus,
    BusConfig,
    BusConnectionError,
    BusNoRespondersError,
    BusTimeoutError,
    RemoteError,
)
from shared.errors import NoFreeBlocksError
from shared.messages import (
    CancelRequest,
    ErrorReply,
    MessageTooLargeError,
    PolicyCommand,
    PolicyReply,
    StatusReply,
    StatusRequest,
    StreamSequencer,
    Subjects,
    SwitchCommand,
    SwitchReply,
    TokenBatch,
    TokenItem,
    decode_reply,
    encode,
)
from tests.support.fixtures import TEST_PASSWORD, TEST_USER
from tests.support.nats_wire import WireError, raw_publish, raw_request

SUBJECTS = Subjects()


@pytest.fixture
async def bus(nats_server_module):
    registry = CollectorRegistry()
    async with Bus(BusConfig(servers=(nats_server_module.url,)), SUBJECTS, registry=registry) as b:
        b.test_registry = registry  # type: ignore[attr-defined]
        yield b


class SwitchTarget:
    """A stand-in worker: its role changes only through valid SwitchCommands."""

    def __init__(self) -> None:
        self.role = "decode"
        self.calls = 0

    async def handle(self, cmd: SwitchCommand) -> SwitchReply:
        self.calls += 1
        old, self.role = self.role, cmd.role
        return SwitchReply(ok=True, from_role=old, to_role=cmd.role)


def uniq(name: str) -> str:
    return f"{name}{os.urandom(3).hex()}"


async def test_request_reply_msgpack(bus):
    target = SwitchTarget()
    subject = SUBJECTS.worker_switch(uniq("w"))
    await bus.serve(subject, SwitchCommand, target.handle)
    reply = await bus.request(subject, SwitchCommand(role="prefill"), SwitchReply, timeout_s=2)
    assert reply == SwitchReply(ok=True, from_role="decode", to_role="prefill")
    assert target.role == "prefill"
    label = "worker.*.switch"
    reg = bus.test_registry
    assert (
        reg.get_sample_value(
            "fluidpd_bus_handled_messages_total", {"subject": label, "outcome": "ok"}
        )
        == 1
    )
    assert (
        reg.get_sample_value("fluidpd_bus_requests_total", {"subject": label, "outcome": "ok"}) == 1
    )
    assert reg.get_sample_value("fluidpd_bus_handler_seconds_count", {"subject": label}) == 1


async def test_json_request_gets_json_reply_via_raw_wire(bus, nats_server_module):
    """What `nats req fluidpd.worker.w3.switch '{"role":"prefill"}'` does."""
    target = SwitchTarget()
    worker_id = uniq("w")
    await bus.serve(SUBJECTS.worker_switch(worker_id), SwitchCommand, target.handle)
    await bus.flush()
    raw = await asyncio.to_thread(
        raw_request,
        nats_server_module.host,
        nats_server_module.port,
        SUBJECTS.worker_switch(worker_id),
        b'{"role":"prefill"}',
        2.0,
    )
    reply = json.loads(raw)
    assert reply["ok"] is True and reply["from"] == "decode" and reply["to"] == "prefill"
    # invalid JSON from an operator: a JSON error reply, and no state change
    raw = await asyncio.to_thread(
        raw_request,
        nats_server_module.host,
        nats_server_module.port,
        SUBJECTS.worker_switch(worker_id),
        b'{"role":"sideways"}',
        2.0,
    )
    reply = json.loads(raw)
    assert reply["ok"] is False and reply["code"] == "invalid_message" and "role" in reply["error"]
    assert target.role == "prefill" and target.calls == 1
    with pytest.raises(WireError, match="no responders"):
        await asyncio.to_thread(
            raw_request,
            nats_server_module.host,
            nats_server_module.port,
            SUBJECTS.worker_switch(uniq("nobody")),
            b"{}",
            2.0,
        )


async def test_empty_status_request_from_cli_gets_json(bus, nats_server_module):
    """`nats req fluidpd.controller.status ''`: an empty payload means {}."""
    seen: list[StatusRequest] = []

    async def on_status(req: StatusRequest) -> StatusReply:
        seen.append(req)
        return StatusReply(auto=True, time_s=1.5)

    subject = SUBJECTS.controller_status() + uniq(".t")
    await bus.serve(subject, StatusRequest, on_status)
    await bus.flush()
    raw = await asyncio.to_thread(
        raw_request, nats_server_module.host, nats_server_module.port, subject, b"", 2.0
    )
    assert json.loads(raw) == {
        "ok": True,
        "auto": True,
        "time_s": 1.5,
        "workers": [],
        "_t": "status_reply",
        "_v": 1,
    }
    assert seen == [StatusRequest()]


async def test_json_cancel_publish_reaches_handler(bus, nats_server_module):
    got: asyncio.Queue[CancelRequest] = asyncio.Queue()

    async def on_cancel(req: CancelRequest) -> None:
        await got.put(req)

    worker_id = uniq("w")
    await bus.serve(SUBJECTS.worker_cancel(worker_id), CancelRequest, on_cancel)
    await bus.flush()
    await asyncio.to_thread(
        raw_publish,
        nats_server_module.host,
        nats_server_module.port,
        SUBJECTS.worker_cancel(worker_id),
        b'{"request_id":"r42"}',
    )
    req = await asyncio.wait_for(got.get(), 2)
    assert req == CancelRequest(request_id="r42")


async def test_handler_errors_become_error_replies_and_serving_continues(bus):
    calls: list[str] = []

    async def handler(cmd: PolicyCommand) -> PolicyReply:
        calls.append("x")
        if len(calls) == 1:
            raise NoFreeBlocksError(needed_blocks=4, free_blocks=1)
        if len(calls) == 2:
            raise RuntimeError("bug with secret details")
        return PolicyReply(ok=True, auto=cmd.auto)

    subject = SUBJECTS.controller_policy() + uniq(".t")  # private subject per test
    await bus.serve(subject, PolicyCommand, handler)
    with pytest.raises(RemoteError) as typed:
        await bus.request(subject, PolicyCommand(auto=False), PolicyReply)
    assert typed.value.code == "kv_capacity_exhausted"
    with pytest.raises(RemoteError) as internal:
        await bus.request(subject, PolicyCommand(auto=False), PolicyReply)
    assert internal.value.code == "internal_error"
    assert "secret" not in str(internal.value)
    reply = await bus.request(subject, PolicyCommand(auto=True), PolicyReply)
    assert reply == PolicyReply(ok=True, auto=True)
    # garbage is answered (msgpack garbage → msgpack error reply) and never reaches the handler
    raw = await bus.nc.request(subject, b"\xc1\xc1", timeout=2)
    err = decode_reply(raw.data, PolicyReply)
    assert isinstance(err, ErrorReply) and err.code == "invalid_message"
    assert len(calls) == 3


async def test_timeouts_no_responders_and_size_limit(bus):
    silent = SUBJECTS.controller_status() + uniq(".silent")

    async def never_answer(msg) -> None:
        pass

    await bus.nc.subscribe(silent, cb=never_answer)
    with pytest.raises(BusTimeoutError):
        await bus.request(silent, StatusRequest(), StatusReply, timeout_s=0.2)
    with pytest.raises(BusNoRespondersError):
        await bus.request(
            SUBJECTS.worker_switch(uniq("gone")),
            SwitchCommand(role="decode"),
            SwitchReply,
            timeout_s=2,
        )
    sequencer = StreamSequencer("d0")
    huge = TokenBatch(
        publisher_id="d0",
        epoch=sequencer.epoch,
        seq=0,
        items=tuple(
            TokenItem(request_id=f"r{i}", token_ids=(2**32 - 1,) * 200) for i in range(1000)
        ),
    )
    with pytest.raises(MessageTooLargeError):
        await bus.publish(SUBJECTS.router_tokens("rt0"), huge)


async def test_stream_subscription_drops_duplicates_and_reports_gaps(bus):
    router_id = uniq("rt")
    subject = SUBJECTS.router_tokens(router_id)
    received: list[int] = []
    gaps: list[tuple[str, int]] = []
    done = asyncio.Event()

    async def on_batch(batch: TokenBatch) -> None:
        received.append(batch.seq)
        if batch.seq == 5:
            done.set()

    await bus.subscribe_stream(
        subject, TokenBatch, on_batch, on_gap=lambda pub, n: gaps.append((pub, n))
    )
    for seq in (0, 1, 1, 3, 2, 5):
        await bus.publish(
            subject,
            TokenBatch(
                publisher_id="d0",
                epoch=7,
                seq=seq,
                items=(TokenItem(request_id="r1", token_ids=(seq,)),),
            ),
        )
    await bus.nc.publish(subject, b"not msgpack")  # counted as invalid, not a crash
    await asyncio.wait_for(done.wait(), 2)
    assert received == [0, 1, 3, 5]
    assert gaps == [("d0", 1), ("d0", 1)]
    reg = bus.test_registry
    assert (
        reg.get_sample_value(
            "fluidpd_bus_stream_gap_messages_total", {"subject": "router.*.tokens"}
        )
        == 2
    )
    assert (
        reg.get_sample_value(
            "fluidpd_bus_handled_messages_total",
            {"subject": "router.*.tokens", "outcome": "duplicate"},
        )
        == 2
    )


async def test_auth_and_idempotent_stop(nats_server_auth):
    server = nats_server_auth
    good = BusConfig(servers=(server.url,), user=TEST_USER, password=TEST_PASSWORD)
    bus = Bus(good, SUBJECTS)
    await bus.start()
    worker_id = uniq("w")
    await bus.serve(SUBJECTS.worker_switch(worker_id), SwitchCommand, SwitchTarget().handle)
    await bus.flush()
    raw = await asyncio.to_thread(
        raw_request,
        server.host,
        server.port,
        SUBJECTS.worker_switch(worker_id),
        b'{"role":"decode"}',
        2.0,
        TEST_USER,
        TEST_PASSWORD,
    )
    assert json.loads(raw)["ok"] is True
    with pytest.raises(WireError):
        await asyncio.to_thread(
            raw_request, server.host, server.port, SUBJECTS.worker_switch(worker_id), b"{}", 2.0
        )
    await bus.stop()
    await bus.stop()  # idempotent
    with pytest.raises(BusConnectionError):
        await bus.publish(SUBJECTS.worker_cancel("w"), CancelRequest(request_id="r"))
    bad = BusConfig(
        servers=(server.url,), user=TEST_USER, password="wrong", initial_connect_deadline_s=0.5
    )
    with pytest.raises(BusConnectionError):
        await Bus(bad, SUBJECTS).start()
    assert "wrong" not in repr(bad)


def test_bus_config_validation():
    with pytest.raises(ValueError):
        BusConfig(servers=())
    with pytest.raises(ValueError):
        BusConfig(user="u")
    with pytest.raises(ValueError):
        BusConfig(user="u", password="p", token="t")
    assert BusConfig.from_url("nats://a:1, nats://b:2").servers == ("nats://a:1", "nats://b:2")


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    payload=st.binary(max_size=64)
    | st.dictionaries(
        st.text(max_size=8), st.integers() | st.text(max_size=8) | st.none(), max_size=3
    ).map(lambda d: json.dumps(d).encode())
    | st.dictionaries(
        st.text(max_size=8), st.integers(-(2**63), 2**63 - 1) | st.binary(max_size=8), max_size=3
    ).map(lambda d: msgpack.packb(d))
)
async def test_fuzz_control_subject_answers_error_or_valid_never_crashes(bus, payload):
    target = SwitchTarget()
    subject = SUBJECTS.worker_switch(uniq("fz"))
    handle = await bus.serve(subject, SwitchCommand, target.handle)
    try:
        raw = await bus.nc.request(subject, payload, timeout=2)
        reply = decode_reply(raw.data, SwitchReply)
        if isinstance(reply, ErrorReply):
            assert target.calls == 0 and target.role == "decode"
        else:
            assert target.calls == 1
        # the subscription still serves
        ok = await bus.request(subject, SwitchCommand(role="prefill"), SwitchReply)
        assert ok.ok and ok.to_role == "prefill"
    finally:
        await handle.stop()


async def test_encode_of_reply_in_json_mode_is_valid_json():
    data = encode(StatusReply(auto=True, time_s=1.0), json_mode=True)
    assert json.loads(data)["workers"] == []
