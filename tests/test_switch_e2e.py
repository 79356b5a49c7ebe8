"""FluidRole in place, with real workers: a switch command sent as raw NATS protocol bytes
(what `nats req` sends) switches a worker; bad commands get error answers and change nothing;
outputs stay identical to `generate`; the switched process keeps its pid."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.generate import generate
from shared.messages import Subjects, SwitchReply, decode_reply
from shared.sampling_params import SamplingParams
from tests.support.nats_server import NatsServer
from tests.support.nats_wire import raw_request
from tests.support.workers import BusClient, start_worker, stop_all

pytestmark = pytest.mark.asyncio(loop_scope="module")
SUBJECTS = Subjects()


@pytest.fixture(scope="module")
def cluster(
    nats_users_module: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("switch-logs")
    args = ("--model", "tiny", "--num-kv-blocks", "256", "--block-size", "4")
    url = nats_users_module
    procs = [
        start_worker("prefill", "p0", url, *args, log_dir=logs),
        start_worker("prefill", "p1", url, *args, log_dir=logs),
        start_worker("decode", "d0", url, *args, log_dir=logs),
    ]
    try:
        yield url
    finally:
        assert stop_all(procs) == [0, 0, 0]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(cluster: str) -> AsyncIterator[BusClient]:
    async with BusClient(cluster) as c:
        await c.wait_workers(["p0", "p1", "d0"])
        yield c


def _wire(server: NatsServer, worker: str, payload: bytes) -> dict:  # type: ignore[type-arg]
    user, password = server.credentials("operator") or (None, None)  # as `nats req` logs in
    subject = SUBJECTS.worker_switch(worker)
    reply = raw_request(server.host, server.port, subject, payload, 5.0, user, password)
    if payload.startswith(b"{"):
        return json.loads(reply)  # JSON in, JSON out (what an operator sees)
    msg = decode_reply(reply, SwitchReply)  # msgpack in, msgpack out
    return {"ok": msg.ok, "error": msg.error}


async def _roles(client: BusClient) -> dict[str, tuple[str, str]]:
    assert client.watcher is not None
    return {r.worker_id: (r.role, r.state) for r in client.watcher.workers()}


async def test_bad_commands_change_nothing(cluster: str, client: BusClient) -> None:
    before = await _roles(client)
    cases = [b'{"role":"banana"}', b"{not json", b'{"role":"prefill"}', b"\xff\xfe", b"{}"]
    for payload in cases:
        answer = await asyncio.to_thread(_wire, cluster, "p0", payload)
        assert answer["ok"] is False and answer["error"], payload
    # d0 is the only decode worker: switching it away would empty the decode role.
    answer = await asyncio.to_thread(_wire, cluster, "d0", b'{"role":"prefill"}')
    assert answer["ok"] is False and "no active decode" in answer["error"]
    assert await _roles(client) == before


async def test_switch_p_to_d_and_back_keeps_outputs(cluster: str, client: BusClient) -> None:
    ref = Engine.load(EngineConfig(model="tiny", block_size=4, num_kv_blocks=512))
    rng = random.Random(9)
    prompts = [[rng.randrange(4, 300) for _ in range(rng.randrange(5, 50))] for _ in range(6)]
    want = [
        o.token_ids for o in generate(ref, prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    ]
    pid_before = client.telemetry["p1"].metrics["pid"]
    # Re-slice: as a prefill worker p1 lends its arena's tail to the prefill workspace (32
    # of 256 blocks for tiny, see test_engine_reslice.py); as a decode worker it has all.
    assert client.telemetry["p1"].total_blocks == 256 - 32
    # Load on p1 while it switches: queued work must be handed to p0, nothing dropped.
    rids = [await client.submit("p1", "d0", p, 10) for p in prompts]
    answer = await asyncio.to_thread(_wire, cluster, "p1", b'{"role":"decode"}')
    assert {k: answer[k] for k in ("ok", "from", "to")} == {
        "ok": True,
        "from": "prefill",
        "to": "decode",
    }
    assert client.watcher is not None
    await client.watcher.wait_until(
        lambda w: (r := w.get("p1")) is not None and r.role == "decode" and r.state == "active",
        30.0,
    )
    assert [(await client.result(r)).token_ids for r in rids] == want
    # p1 now decodes: route a request p0 -> p1.
    rid = await client.submit("p0", "p1", prompts[0], 10)
    assert (await client.result(rid)).token_ids == want[0]
    assert client.telemetry["p1"].metrics["pid"] == pid_before
    await client.wait_telemetry(lambda t: t["p1"].role == "decode" and t["p1"].total_blocks == 256)
    # As a decode worker p1 now listens to prefill telemetry: it offers p0 a steal budget.
    await client.wait_telemetry(lambda t: "p0" in t["p1"].steal_budgets)
    # And back.
    answer = await asyncio.to_thread(_wire, cluster, "p1", b'{"role":"prefill"}')
    assert answer["ok"] is True
    await client.watcher.wait_until(
        lambda w: (r := w.get("p1")) is not None and r.role == "prefill" and r.state == "active",
        30.0,
    )
    rid = await client.submit("p1", "d0", prompts[1], 10)
    assert (await client.result(rid)).token_ids == want[1]
    await client.wait_telemetry(lambda t: t["p1"].role == "prefill" and t["p1"].total_blocks == 224)
    await client.wait_telemetry(
        lambda t: all(t[w].free_blocks == t[w].total_blocks for w in ("p0", "p1", "d0"))
    )


@pytest.fixture(scope="module")
def decode_pair(
    nats_users_module: NatsServer, tmp_path_factory: pytest.TempPathFactory, cluster: str
) -> Iterator[str]:
    """A second decode worker d1 joins the cluster (for D->P with live migration)."""
    logs = tmp_path_factory.mktemp("switch-logs-d1")
    args = ("--model", "tiny", "--num-kv-blocks", "256", "--block-size", "4")
    # Every running request counts as long (a fast machine finishes tiny decodes in ms).
    proc = start_worker(
        "decode", "d1", cluster, *args, "--migrate-min-remaining-s", "0", log_dir=logs
    )
    try:
        yield "d1"
    finally:
        assert stop_all([proc]) == [0]


async def test_d_to_p_live_migration_keeps_streams_exact(
    cluster: str, client: BusClient, decode_pair: str
) -> None:
    await client.wait_workers(["d1"])
    ref = Engine.load(EngineConfig(model="tiny", block_size=4, num_kv_blocks=512))
    rng = random.Random(21)
    prompts = [[rng.randrange(4, 300) for _ in range(rng.randrange(5, 40))] for _ in range(4)]
    n = 150
    # Asking for logprobs too: the peer goes on computing them after the move.
    outs = generate(ref, prompts, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=2))
    want = [o.token_ids for o in outs]
    rids = [await client.submit("p0", "d1", p, n, logprobs=2) for p in prompts]
    # Switch once every request is decoding on d1 (some tokens streamed already).
    await client.wait_telemetry(
        lambda t: all(
            len(client.results.get(r, None).token_ids) > 5 if r in client.results else False
            for r in rids
        )
    )
    answer = await asyncio.to_thread(_wire, cluster, "d1", b'{"role":"prefill"}')
    assert answer["ok"] is True
    results = [await client.result(r) for r in rids]
    for got, w in zip(results, want, strict=True):
        assert got.error is None
        assert got.indices == list(range(n)), "a gap or a repeated token in the stream"
        assert got.token_ids == w
    for got, o in zip(results, outs, strict=True):
        assert len(got.logprobs) == n
        assert all(
            abs(a.logprob - b.logprob) < 1e-4 and a.top_ids == b.top_ids
            for a, b in zip(got.logprobs, o.logprobs, strict=True)
        )
    assert client.watcher is not None
    await client.watcher.wait_until(
        lambda w: (r := w.get("d1")) is not None and r.role == "prefill" and r.state == "active",
        30.0,
    )
    await client.wait_telemetry(
        lambda t: all(t[w].free_blocks == t[w].total_blocks for w in ("p0", "p1", "d0", "d1"))
    )
    # The long requests were live-migrated (not waited for): d1 sent them, d0 took them.
    moved = client.telemetry["d1"].metrics["migrations_out_total"]
    assert moved >= 1 and client.telemetry["d0"].metrics["migrations_in_total"] == moved
    # Every moved stream told the router first: d1's hand-over to d0 arrived before d0's
    # first token (the router takes tokens only from workers it was told of; a peer that
    # is itself leaving decode is not recognised otherwise).
    streams = [client.streams[r] for r in rids]
    moved_streams = [st for st in streams if "d0" in st.publishers]
    assert len(moved_streams) == moved
    for st in moved_streams:
        first_d0 = st.publishers.index("d0")
        notices = [(p, to, role) for p, to, role, at in st.hand_overs if at <= first_d0]
        assert ("d1", "d0", "decode") in notices, st.hand_overs
