"""FluidRole in the configuration users run: a default ``fluidpd up`` (its own nats-server
with least-privilege users, the shipped door and policy; model ``tiny`` on the emulated
engine so four workers fit two cores) switched by an operator with ``fluidpd ctl switch``
while clients stream through the router. Before the permissions table, every such switch
answered "the controller did not grant a switch lease" (the worker user could not publish
the lease request): shown here is the answer ``ok``, the new role in ``ctl status``, and
no request of the load failing."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from tests.support.faults import completion, prompt
from tests.support.up_process import UpProcess

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(240)]
CLIENTS, PER_CLIENT, OUT_TOKENS = 8, 6, 40


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[UpProcess, dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("shipped")
    state_file = tmp / "up.json"
    args = ["--model", "tiny", "--engine", "emulated", "--prefill", "2", "--decode", "2"]
    args += ["--port", "0", "--log-dir", str(tmp / "logs")]
    proc = UpProcess(args, state_file)
    try:
        proc.wait_ready(150)
        yield proc, json.loads(state_file.read_text())
    finally:
        if proc.proc.poll() is None:
            proc.kill_tree()


def _ctl(up: UpProcess, *args: str) -> subprocess.CompletedProcess[str]:
    """``fluidpd ctl …`` as an operator runs it: credentials from the up state file."""
    cmd = [sys.executable, "-m", "services.cli.main", "ctl", *args]
    return subprocess.run(cmd, env=up.env, capture_output=True, text=True, timeout=60)


def _roles(up: UpProcess) -> dict[str, tuple[str, str]]:
    out = _ctl(up, "status", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    workers = doc["workers"] if isinstance(doc, dict) else doc
    return {w["id"]: (w["role"], w["state"]) for w in workers}


async def _client(session: aiohttp.ClientSession, url: str, index: int) -> list[str]:
    kinds = []
    for i in range(PER_CLIENT):
        out = await completion(
            session, url, prompt(index * 100 + i, 256), OUT_TOKENS, deadline_s=120
        )
        kinds.append(out.kind if out.kind == "completed" else f"{out.kind}: {out.error}")
    return kinds


async def test_operator_switch_under_load_succeeds_and_no_request_fails(
    up: tuple[UpProcess, dict[str, Any]],
) -> None:
    proc, state = up
    url = state["router_url"]
    assert _roles(proc)["p1"][0] == "prefill"
    async with aiohttp.ClientSession() as session:
        load = [asyncio.ensure_future(_client(session, url, c)) for c in range(CLIENTS)]
        await asyncio.sleep(0)  # the load is in flight before the switch is sent
        switched = await asyncio.to_thread(_ctl, proc, "switch", "p1", "decode")
        assert switched.returncode == 0, switched.stdout + switched.stderr
        assert '"ok": true' in switched.stdout.replace("'", '"'), switched.stdout
        kinds = [k for ks in await asyncio.gather(*load) for k in ks]
    assert kinds == ["completed"] * (CLIENTS * PER_CLIENT), [k for k in kinds if k != "completed"]
    roles = await _wait_role(proc, "p1", "decode")
    assert roles["p1"] == ("decode", "active")


async def _wait_role(proc: UpProcess, worker: str, role: str) -> dict[str, tuple[str, str]]:
    for _ in range(100):  # ctl status is a request: poll it, 0.2 s apart, 20 s at most
        roles = await asyncio.to_thread(_roles, proc)
        if roles.get(worker) == (role, "active"):
            return roles
        await asyncio.sleep(0.2)
    return roles
