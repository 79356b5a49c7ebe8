"""The controller against a real nats-server with fake workers (registry + telemetry only):
`fluidpd ctl` status/policy in a subprocess, liveness, decisions, switch commands."""

# ruff: noqa: F811  (pytest fixtures imported from tests.support.fixtures)
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator

import pytest

from services.controller import Controller, ControllerConfig
from shared.bus import Bus, BusConfig
from shared.messages import ControllerDecision, PolicyReply, SwitchReply, decode
from shared.policy.config import PolicyConfig
from tests.support.fake_workers import (
    HEARTBEAT_S,
    SUBJECTS,
    FakeWorker,
    decisions_on,
    started,
    wait_any_switched,
    wait_for,
)
from tests.support.fixtures import nats_server  # noqa: F401
from tests.support.nats_server import NatsServer

pytestmark = pytest.mark.timeout(60)


def config(url: str, **policy: float) -> ControllerConfig:
    pol = PolicyConfig(decision_interval_s=0.1, **policy)
    return ControllerConfig(bus=BusConfig.from_url(url), policy=pol, heartbeat_s=HEARTBEAT_S)


@pytest.fixture
async def controller(nats_server: NatsServer) -> AsyncIterator[Controller]:
    async with Controller(config(nats_server.url)) as ctl:
        yield ctl


async def run_ctl(*args: str) -> tuple[int, str, str]:
    env = {**os.environ, "FLUIDPD_STATE_FILE": "/nonexistent/fluidpd-up.json"}
    env.pop("FLUIDPD_NATS_URL", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli.ctl",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_ctl_status_lists_workers(controller: Controller, nats_server: NatsServer) -> None:
    p0 = FakeWorker(nats_server.url, "p0", "prefill", ppi=0.75, free_blocks=80)
    d0 = FakeWorker(
        nats_server.url, "d0", "decode", dpi_load=0.3, dpi_adm=0.1, stolen_tokens_total=7
    )
    await p0.start()
    await d0.start()
    try:
        await wait_for(
            lambda: (
                {r.worker_id for r in controller.status().workers if r.last_seen_s >= 0}
                == {"p0", "d0"}
            )
        )
        rc, out, err = await run_ctl("status", "--json", "--nats", nats_server.url)
        assert rc == 0, err
        rows = {r["id"]: r for r in json.loads(out)}
        assert set(rows) == {"p0", "d0"}
        assert rows["p0"]["role"] == "prefill" and rows["p0"]["state"] == "active"
        assert (rows["p0"]["free_blocks"], rows["p0"]["total_blocks"]) == (80, 100)
        assert rows["p0"]["ppi"] == pytest.approx(0.75)
        assert rows["d0"]["role"] == "decode"
        assert rows["d0"]["dpi_load"] == pytest.approx(0.3)
        assert rows["d0"]["dpi_adm"] == pytest.approx(0.1)
        assert rows["d0"]["stolen_tokens"] == 7
        assert rows["d0"]["pid"] == 4242
        rc, out, _ = await run_ctl("status", "--nats", nats_server.url)
        assert rc == 0
        assert "p0" in out and "d0" in out and "80/100" in out and "policy: auto" in out
    finally:
        await p0.stop()
        await d0.stop()


async def test_dead_worker_drops_out(controller: Controller, nats_server: NatsServer) -> None:
    live = FakeWorker(nats_server.url, "d1", "decode")
    dead = FakeWorker(nats_server.url, "d2", "decode")
    await live.start()
    await dead.start()
    try:
        await controller.watcher.wait_until(lambda w: len(w.workers()) == 2, 5.0)
        await dead.crash()
        await controller.watcher.wait_until(lambda w: w.get("d2") is None, 5.0)
        async with Bus(BusConfig.from_url(nats_server.url), SUBJECTS) as bus:
            reply = await bus.nc.request(SUBJECTS.controller_status(), b"{}", timeout=2)
        ids = [w["worker_id"] for w in json.loads(reply.data)["workers"]]
        assert ids == ["d1"]
    finally:
        await live.stop()
        await dead.stop()


async def test_policy_pause_resume(controller: Controller, nats_server: NatsServer) -> None:
    rc, out, err = await run_ctl("policy", "pause", "--nats", nats_server.url)
    assert rc == 0, err
    answer = json.loads(out)
    assert answer["ok"] is True and answer["auto"] is False
    assert controller.auto is False
    decision = await controller.decide_once()
    assert decision.reason == "paused"
    # Plain JSON, as an operator would send with the NATS CLI.
    async with Bus(BusConfig.from_url(nats_server.url), SUBJECTS) as bus:
        raw = await bus.nc.request(SUBJECTS.controller_policy(), b'{"auto": true}', timeout=2)
    assert decode(raw.data, PolicyReply).auto is True
    assert controller.auto is True


async def test_decision_published_each_interval(
    controller: Controller, nats_server: NatsServer
) -> None:
    got: list[ControllerDecision] = []
    three = asyncio.Event()

    async def on_decision(msg: ControllerDecision) -> None:
        got.append(msg)
        if len(got) >= 3:
            three.set()

    async with Bus(BusConfig.from_url(nats_server.url), SUBJECTS) as bus:
        await bus.subscribe_stream(SUBJECTS.controller_decisions(), ControllerDecision, on_decision)
        start = time.monotonic()
        await asyncio.wait_for(three.wait(), 5.0)
        elapsed = time.monotonic() - start
    assert [m.seq for m in got[:3]] == [got[0].seq, got[0].seq + 1, got[0].seq + 2]
    assert all(m.action == "none" for m in got)
    assert {"ppi_bar", "dpi_load_bar", "dpi_adm_bar"} <= set(got[0].inputs)
    assert elapsed < 2.0  # interval 0.1 s: three decisions well within 2 s
    assert controller.metrics.decisions_total.labels(action="none")._value.get() >= 3


async def test_switch_sent_and_refusal_tolerated(nats_server: NatsServer) -> None:
    # Prefill under pressure, decode idle, two decode workers: eq. 22 → D→P at once.
    cfg = config(nats_server.url, n_persist=1, cooldown_s=0.0)
    refuse = SwitchReply(ok=False, error="switching not implemented")
    p0 = FakeWorker(nats_server.url, "p0", "prefill", ppi=3.0)
    d0 = FakeWorker(nats_server.url, "d0", "decode", running=5)
    d1 = FakeWorker(nats_server.url, "d1", "decode", running=1)
    for w in (p0, d0, d1):
        await w.start(switch_reply=refuse)
    try:
        async with Controller(cfg) as ctl:
            await asyncio.wait_for(d1.switched.wait(), 10.0)
            assert d1.switches[0].role == "prefill"
            assert not d0.switches  # the candidate with the fewest running requests
            before = ctl.decisions_total
            await wait_for(lambda: ctl.decisions_total >= before + 2)  # loop carries on
            assert ctl.metrics.switches_total.labels(outcome="refused")._value.get() >= 1
    finally:
        for w in (p0, d0, d1):
            await w.stop()


async def test_a_filling_decode_flow_holds_a_d2p_move_until_it_settles(
    nats_server: NatsServer,
) -> None:
    # Real bus and controller, fake workers. Prefill pressured, decode lightly used (10 of 64
    # slots on each of 2 workers): eq. 22 says D->P. But 4x as many requests enter decode as
    # leave it: where that flow settles (decode_flow.py; 80, twice that with a second
    # prefill worker) needs every decode worker, so the controller holds the move
    # (decode_headroom) until the counters show a steady flow (20 → 40 after the move: one
    # decode worker's 48 at the 0.75 fill target).
    cfg = config(nats_server.url, n_persist=1, cooldown_s=0.0, decode_flow_window_s=1.0)
    fill = {"running": 10, "entered_per_publish": 4.0, "left_per_publish": 1.0}
    url = nats_server.url
    workers = [FakeWorker(url, "p0", "prefill", ppi=0.0)]
    workers += [FakeWorker(url, f"d{i}", "decode", **fill) for i in range(2)]
    async with started(workers, SwitchReply(ok=True)):
        async with decisions_on(url) as decisions, Controller(cfg):
            # The meter needs a window of history first: no pressure until it has one.
            await wait_for(
                lambda: any(m.inputs.get("decode_flow_forecast", 0.0) > 60.0 for m in decisions)
            )
            workers[0].telemetry["ppi"] = 3.0
            await wait_for(
                lambda: any(
                    m.reason == "decode_headroom"
                    and m.inputs.get("decode_flow_forecast", 0.0) > 60.0
                    for m in decisions
                )
            )
            assert not any(w.switches for w in workers)
            for w in workers[1:]:  # the flow settles: as many leave as enter
                w.telemetry["left_per_publish"] = 4.0
            await wait_any_switched(workers[1:])
        moved = [w for w in workers if w.switches]
        assert len(moved) == 1 and moved[0].switches[0].role == "prefill"
        last = next(m for m in reversed(decisions) if m.action != "none")
        assert last.inputs["decode_flow_forecast"] < 30.0  # ~ the 20 in decode now


async def test_full_decode_slots_that_keep_up_hold_the_split_until_requests_wait(
    nats_server: NatsServer,
) -> None:
    # Real bus and controller, fake workers. Prefill pressured (PPI 3.0) and both decode
    # workers' 64 slots full (DPI_adm 1.0), but only 10 requests wait on each (0.16 of a
    # batch): decode keeps up, so no move (both_phases_short), and the decisions publish
    # the waiting share. Once 40 wait on each (0.63 >= 0.5), decode admission blocks
    # prefill and one prefill worker moves to decode.
    cfg = config(nats_server.url, n_persist=1, cooldown_s=0.0)
    full = {"running": 64, "dpi_load": 0.9, "dpi_adm": 1.0, "decode_waiting": 10.0}
    url = nats_server.url
    workers = [FakeWorker(url, f"p{i}", "prefill", ppi=3.0) for i in range(2)]
    workers += [FakeWorker(url, f"d{i}", "decode", **full) for i in range(2)]
    async with started(workers, SwitchReply(ok=True)):
        async with decisions_on(url) as decisions, Controller(cfg):
            await wait_for(lambda: any(m.reason == "both_phases_short" for m in decisions))
            held = next(m for m in decisions if m.reason == "both_phases_short")
            assert held.inputs["decode_waiting_batches"] == pytest.approx(10 / 64)
            assert not any(w.switches for w in workers)
            for w in workers[2:]:
                w.telemetry["decode_waiting"] = 40.0
            await wait_any_switched(workers[:2])
        moved = [w for w in workers if w.switches]
        assert len(moved) == 1 and moved[0].switches[0].role == "decode"
        last = next(m for m in reversed(decisions) if m.action != "none")
        assert last.reason == "decode_admission_blocks_prefill"
        assert last.inputs["decode_waiting_batches"] == pytest.approx(40 / 64)


async def test_ctl_clear_errors(nats_server: NatsServer) -> None:
    rc, out, err = await run_ctl("status", "--nats", nats_server.url, "--timeout", "1")
    assert rc == 2 and out == ""
    assert err.strip().startswith("fluidpd ctl: no answer from the controller")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    rc, _, err = await run_ctl("status", "--nats", "nats://127.0.0.1:1")
    assert rc == 2
    assert err.strip() == "fluidpd ctl: cannot reach NATS at nats://127.0.0.1:1"


async def test_metrics_endpoint(nats_server: NatsServer) -> None:
    from services.common.nats_server import free_port

    port = free_port()
    cfg = ControllerConfig(
        bus=BusConfig.from_url(nats_server.url),
        policy=PolicyConfig(decision_interval_s=0.1),
        metrics_port=port,
    )
    async with Controller(cfg) as ctl:
        await wait_for(lambda: ctl.decisions_total >= 1)
        body = await asyncio.to_thread(
            lambda: (
                __import__("urllib.request")
                .request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
                .read()
                .decode()
            )
        )
    assert 'fluidpd_controller_decisions_total{action="none"}' in body
    assert "fluidpd_controller_ppi_bar" in body
