"""Fault suite: real nats-server, real router/controller/worker processes (emulated engine,
model tiny, real KV accounting and real UCX transfers), real faults (SIGKILL, SIGSTOP,
nats-server restart, full KV pools, client disconnects, role switches).

Each case asserts: every request ends within its client deadline with its tokens or a
clear error (``hung`` == 0), the surviving workers' free-block counts return to their
totals (from telemetry), and the cluster serves new requests afterwards. Each case adds a
row to the fault table, printed at the end of the session (and written to
``$FLUIDPD_FAULT_TABLE`` when set); docs/reliability.md holds a copy.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from shared.messages import SwitchCommand, SwitchReply
from tests.support.faults import (
    Disconnect,
    FaultTable,
    Outcome,
    completion,
    fault_cluster,
    leaked_blocks,
    prompt,
    serves_new_requests,
    sigkill,
    summarize_errors,
    wait_healthy,
)
from tests.support.nats_server import NatsServer
from tests.support.workers import BusClient

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def table(request: pytest.FixtureRequest) -> Iterator[FaultTable]:
    collected = FaultTable()
    yield collected
    text = collected.markdown()
    target = os.environ.get("FLUIDPD_FAULT_TABLE")
    if target:
        Path(target).write_text(text, encoding="utf-8")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("\nFault table (tests/test_faults.py):\n" + text)


def _launch(
    session: aiohttp.ClientSession,
    url: str,
    specs: list[tuple[int, int, int, Disconnect | None]],
    *,
    deadline_s: float = 25.0,
    stream: bool = True,
) -> list[asyncio.Future[Outcome]]:
    """(prompt seed, prompt tokens, max tokens, disconnect) -> running request futures."""
    return [
        asyncio.ensure_future(
            completion(
                session,
                url,
                prompt(seed, n),
                max_tokens,
                deadline_s=deadline_s,
                stream=stream,
                disconnect=dis,
            )
        )
        for seed, n, max_tokens, dis in specs
    ]


async def _switch(client: BusClient, worker_id: str, role: str) -> SwitchReply:
    return await client.bus.request(
        client.subjects.worker_switch(worker_id), SwitchCommand(role=role), SwitchReply, 5.0
    )


async def _gone(client: BusClient, worker_id: str, timeout_s: float = 10.0) -> None:
    assert client.watcher is not None
    await client.watcher.wait_until(lambda w: w.get(worker_id) is None, timeout_s)


def _check(
    table: FaultTable,
    case: str,
    outcomes: list[Outcome],
    leaked: dict[str, int],
    new: list[Outcome],
    *,
    notes: str = "",
) -> None:
    row = table.add(case, outcomes, leaked, notes or summarize_errors(outcomes))
    for o in outcomes:
        print("OUTCOME", case, o)
    assert row.hung == 0, [o for o in outcomes if o.kind == "hung"]
    for o in outcomes:
        if o.kind == "failed":  # a clear error: an OpenAI error object with a code
            assert o.error_code, o
    assert leaked == {}, f"blocks still held: {leaked}"
    assert [o.kind for o in new] == ["completed"] * len(new), new


# ----------------------------------------------------------------------------- cases
async def test_decode_killed_mid_decode(tmp_path: Path, table: FaultTable) -> None:
    with fault_cluster(tmp_path, prefill=1, decode=2) as c:
        async with BusClient(c.nats_url) as client, aiohttp.ClientSession() as s:
            await client.wait_workers(["p0", "d0", "d1"])
            futs = _launch(s, c.router_url, [(i, 256, 150, None) for i in range(6)])
            await client.wait_telemetry(lambda t: "d0" in t and t["d0"].running >= 2, 15)
            sigkill(c, "d0")
            outcomes = list(await asyncio.gather(*futs))
            leaked = await leaked_blocks(client, ["p0", "d1"])
            await _gone(client, "d0")
            new = await serves_new_requests(c.router_url)
    _check(table, "decode worker SIGKILLed mid-decode", outcomes, leaked, new)
    assert any(o.kind == "completed" for o in outcomes)  # d1's requests were not touched
    assert any(o.error_code == "worker_lost" for o in outcomes)


async def test_decode_killed_mid_transfer(tmp_path: Path, table: FaultTable) -> None:
    # SIGSTOP d0 once it has reserved blocks for a request (the prefill of that request is
    # still running on p0), let p0 reach the KV export, then SIGKILL d0: the sender is
    # blocked mid-transfer toward a dead peer and must give up at its deadline.
    with fault_cluster(tmp_path, prefill=1, decode=2) as c:
        async with BusClient(c.nats_url) as client, aiohttp.ClientSession() as s:
            await client.wait_workers(["p0", "d0", "d1"])
            futs = _launch(s, c.router_url, [(i, 8000, 40, None) for i in range(4)])
            await client.wait_telemetry(
                lambda t: "d0" in t and t["d0"].free_blocks < t["d0"].total_blocks, 15
            )
            c.kill_worker("d0", signal.SIGSTOP)
            await asyncio.sleep(1.0)  # fault timing: p0 finishes the 8000-token prefill
            sigkill(c, "d0")
            outcomes = list(await asyncio.gather(*futs))
            leaked = await leaked_blocks(client, ["p0", "d1"])
            await _gone(client, "d0")
            new = await serves_new_requests(c.router_url)
    _check(table, "decode worker SIGKILLed mid-transfer", outcomes, leaked, new)
    assert any(o.kind == "failed" for o in outcomes)


async def test_prefill_killed_with_queue(tmp_path: Path, table: FaultTable) -> None:
    with fault_cluster(tmp_path, prefill=2, decode=1) as c:
        async with BusClient(c.nats_url) as client, aiohttp.ClientSession() as s:
            await client.wait_workers(["p0", "p1", "d0"])
            futs = _launch(s, c.router_url, [(i, 4000, 30, None) for i in range(12)])
            await client.wait_telemetry(lambda t: "p0" in t and t["p0"].queue_len >= 3, 15)
            sigkill(c, "p0")
            outcomes = list(await asyncio.gather(*futs))
            leaked = await leaked_blocks(client, ["p1", "d0"])
            await _gone(client, "p0")
            new = await serves_new_requests(c.router_url)
    _check(table, "prefill worker SIGKILLed with a queue", outcomes, leaked, new)
    assert any(o.error_code == "worker_lost" for o in outcomes)
    assert any(o.kind == "completed" for o in outcomes)


async def test_nats_restart_under_load(tmp_path: Path, table: FaultTable) -> None:
    server = NatsServer(tmp_path / "js")
    server.start()
    try:
        with fault_cluster(tmp_path / "logs", prefill=1, decode=1, nats_url=server.url) as c:
            async with BusClient(c.nats_url) as client, aiohttp.ClientSession() as s:
                await client.wait_workers(["p0", "d0"])
                futs = []
                for i in range(10):  # arrivals spread over the restart
                    futs += _launch(s, c.router_url, [(i, 512, 100, None)])
                    if i == 4:
                        await asyncio.to_thread(server.restart)
                    await asyncio.sleep(0.2)  # the arrival schedule, not a sync
                outcomes = list(await asyncio.gather(*futs))
                await client.wait_workers(["p0", "d0"], timeout_s=20)
                await wait_healthy(c.router_url)
                leaked = await leaked_blocks(client, ["p0", "d0"])
                new = await serves_new_requests(c.router_url)
    finally:
        server.stop()
    _check(table, "nats-server restarted under load", outcomes, leaked, new)


async def test_full_kv_pool(tmp_path: Path, table: FaultTable) -> None:
    # 64 blocks x 16 tokens per worker; each request needs 44 blocks: one at a time fits.
    with fault_cluster(tmp_path, prefill=1, decode=2, num_kv_blocks=64) as c:
        async with BusClient(c.nats_url) as client, aiohttp.ClientSession() as s:
            await client.wait_workers(["p0", "d0", "d1"])
            specs = [(i, 400, 250, None) for i in range(6)]
            futs = _launch(s, c.router_url, specs, stream=False)
            outcomes = list(await asyncio.gather(*futs))
            leaked = await leaked_blocks(client, ["p0", "d0", "d1"])
            alive = [w for w, ch in c.workers.items() if ch.is_running()]
            new = await serves_new_requests(c.router_url)
    _check(table, "full KV pool on every decode worker", outcomes, leaked, new)
    assert alive == ["p0", "d0", "d1"], "a full pool must never crash a worker"
    for o in outcomes:  # queued and served, or a 503 with Retry-After (or the router's 504)
        assert o.kind in ("completed", "timed_out") or (o.status == 503 and o.retry_after), o
    assert any(o.kind == "completed" for o in outcomes)


@pytest.mark.xfail(
    strict=True,
    reason="bug: prefill admission retries are head-of-line blocking and anchored on when a "
    "job reaches the queue head (services/worker/prefill_role.py _admit give_up_s), and a "
    "request larger than any decode KV pool is retried instead of refused: requests behind "
    "a full pool wait for the router's request timeout instead of a prompt 503",
)
async def test_full_kv_pool_answers_promptly(tmp_path: Path) -> None:
    # Every request needs 41 of the 64 blocks: one at a time fits. Each must be served or
    # refused with 503 + Retry-After within TTFT budget (2 s) + admit timeout (5 s) + slack,
    # and one larger than the whole pool (138 blocks) must be refused outright.
    with fault_cluster(tmp_path, prefill=1, decode=1, num_kv_blocks=64) as c:
        async with aiohttp.ClientSession() as s:
            futs = _launch(s, c.router_url, [(i, 400, 250, None) for i in range(5)], stream=False)
            futs += _launch(s, c.router_url, [(99, 200, 2000, None)], stream=False)
            outcomes = list(await asyncio.gather(*futs))
    for o in outcomes:
        assert o.ended_s is not None and o.ended_s < 9.0, o
        assert o.kind == "completed" or (o.status == 503 and o.retry_after), o


async def test_client_disconnects_at_every_stage(tmp_path: Path, table: FaultTable) -> None:
    with fault_cluster(tmp_path, prefill=1, decode=1) as c:
        async with BusClient(c.nats_url) as client, aiohttp.ClientSession() as s:
            await client.wait_workers(["p0", "d0"])
            stages = [
                (1, 6000, 100, Disconnect(after_s=0.2)),  # prefilling (0.57 s prefill)
                (2, 6000, 100, Disconnect(after_s=0.3)),  # queued behind it
                (3, 6000, 100, Disconnect(after_s=0.3)),  # queued
                (4, 6000, 100, Disconnect(after_tokens=1)),  # first token: KV in transfer
                (5, 1000, 200, Disconnect(after_tokens=20)),  # decoding
                (6, 1000, 50, None),  # completes
            ]
            futs = []
            for spec in stages:  # in order: the prefill queue is FIFO
                futs += _launch(s, c.router_url, [spec])
                await asyncio.sleep(0.02)  # the arrival order, not a sync
            outcomes = list(await asyncio.gather(*futs))
            leaked = await leaked_blocks(client, ["p0", "d0"])
            new = await serves_new_requests(c.router_url)
    _check(
        table,
        "client disconnects (queued, prefilling, transferring, decoding)",
        outcomes,
        leaked,
        new,
    )
    assert [o.kind for o in outcomes] == ["disconnected"] * 5 + ["completed"], outcomes


async def test_stalled_transfer_hits_deadline(tmp_path: Path, table: FaultTable) -> None:
    # The decode worker is SIGSTOPped after reserving blocks: it stops reading; the prefill
    # worker's export must give up at its deadline (2 s), and after SIGCONT the decode
    # worker must free the reservation and serve again.
    with fault_cluster(tmp_path, prefill=1, decode=1) as c:
        async with BusClient(c.nats_url) as client, aiohttp.ClientSession() as s:
            await client.wait_workers(["p0", "d0"])
            futs = _launch(s, c.router_url, [(7, 8000, 20, None)])
            await client.wait_telemetry(
                lambda t: "d0" in t and t["d0"].free_blocks < t["d0"].total_blocks, 15
            )
            c.kill_worker("d0", signal.SIGSTOP)
            try:
                outcomes = list(await asyncio.gather(*futs))
            finally:
                c.kill_worker("d0", signal.SIGCONT)
            await client.wait_workers(["d0"], timeout_s=15)
            leaked = await leaked_blocks(client, ["p0", "d0"])
            await wait_healthy(c.router_url)
            new = await serves_new_requests(c.router_url)
    _check(table, "stalled transfer (decode SIGSTOPped)", outcomes, leaked, new)
    assert outcomes[0].kind == "failed"
    assert outcomes[0].ended_s is not None and outcomes[0].ended_s < 8.0, outcomes[0]


async def test_switch_during_client_disconnects(tmp_path: Path, table: FaultTable) -> None:
    with fault_cluster(tmp_path, prefill=2, decode=2) as c:
        async with BusClient(c.nats_url) as client, aiohttp.ClientSession() as s:
            await client.wait_workers(["p0", "p1", "d0", "d1"])
            specs = [
                (i, 3000, 100, Disconnect(after_s=0.1 + 0.25 * i) if i % 2 else None)
                for i in range(10)
            ]
            futs = _launch(s, c.router_url, specs)
            await client.wait_telemetry(lambda t: "p1" in t and t["p1"].queue_len >= 1, 15)
            reply = await _switch(client, "p1", "decode")
            assert reply.ok, reply
            outcomes = list(await asyncio.gather(*futs))
            assert client.watcher is not None
            await client.watcher.wait_until(
                lambda w: (r := w.get("p1")) is not None and (r.role, r.state) == ("decode", "active"),
                20.0,
            )
            leaked = await leaked_blocks(client, ["p0", "p1", "d0", "d1"])
            new = await serves_new_requests(c.router_url, n=4)
    _check(table, "P->D switch during client disconnects", outcomes, leaked, new)
    assert [o.kind for o in outcomes[0::2]] == ["completed"] * 5, outcomes


async def test_switch_while_worker_killed(tmp_path: Path, table: FaultTable) -> None:
    with fault_cluster(tmp_path, prefill=2, decode=2) as c:
        async with BusClient(c.nats_url) as client, aiohttp.ClientSession() as s:
            await client.wait_workers(["p0", "p1", "d0", "d1"])
            futs = _launch(s, c.router_url, [(i, 1500, 120, None) for i in range(8)])
            await client.wait_telemetry(lambda t: "d0" in t and t["d0"].running >= 1, 15)
            sigkill(c, "d0")
            reply = await _switch(client, "p1", "decode")
            assert reply.ok, reply
            outcomes = list(await asyncio.gather(*futs))
            await _gone(client, "d0")
            assert client.watcher is not None
            await client.watcher.wait_until(
                lambda w: (r := w.get("p1")) is not None and (r.role, r.state) == ("decode", "active"),
                20.0,
            )
            leaked = await leaked_blocks(client, ["p0", "p1", "d1"])
            new = await serves_new_requests(c.router_url, n=4)
    _check(table, "P->D switch while a decode worker is SIGKILLed", outcomes, leaked, new)
