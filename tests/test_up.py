"""`fluidpd up` as a real process tree: ready line, /health, `fluidpd ctl` through the
recorded state file, SIGTERM → exit 0 with no surviving child; early child failure."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.support.up_process import UpProcess

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def state_file(tmp_path: Path) -> Path:
    return tmp_path / "up.json"


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture
def up(state_file: Path) -> Iterator[UpProcess]:
    proc = UpProcess(
        [
            "--model",
            "tiny",
            "--engine",
            "torch",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--port",
            "0",  # the router binds a free port itself and reports it
            "--threads",
            "1",
        ],
        state_file,
    )
    try:
        yield proc
    finally:
        if proc.proc.poll() is None:
            proc.kill_tree()


def test_up_serves_and_stops_cleanly(up: UpProcess, state_file: Path) -> None:
    up.wait_ready(90)
    state = json.loads(state_file.read_text())
    url = state["router_url"]
    assert url.startswith("http://127.0.0.1:") and int(url.rsplit(":", 1)[1]) > 0, url
    # The banner and the ready line name the port the router really bound (--port 0).
    assert any(f"curl {url}/v1/chat/completions" in line for line in up.lines)
    assert any(line.startswith(f"fluidpd up: ready: router {url},") for line in up.lines)
    with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
        assert resp.status == 200

    assert state["pid"] == up.proc.pid
    assert set(state["pids"]) == {"nats", "controller", "router", "p0", "d0"}
    assert state["nats_url"].startswith("nats://127.0.0.1:") and state["nats_url"][-2:] != ":0"

    # ctl finds the cluster through the state file (no --nats, no FLUIDPD_NATS_URL).
    ctl = subprocess.run(
        [sys.executable, "-m", "services.cli.ctl", "status", "--json"],
        env=up.env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ctl.returncode == 0, ctl.stderr
    rows = {r["id"]: r for r in json.loads(ctl.stdout)}
    assert {k: rows[k]["role"] for k in rows} == {"p0": "prefill", "d0": "decode"}
    assert all(r["state"] == "active" and r["total_blocks"] > 0 for r in rows.values())

    tree = [p.pid for p in psutil.Process(up.proc.pid).children(recursive=True)]
    assert set(state["pids"].values()) <= set(tree)
    start = time.monotonic()
    up.proc.send_signal(signal.SIGTERM)
    rc = up.proc.wait(15)
    assert rc == 0, up.output()
    assert time.monotonic() - start < 15
    assert alive(tree) == [], f"survivors: {alive(tree)}"
    assert not state_file.exists()
    assert up.lines[-1] == "fluidpd up: stopped"


def test_up_fails_clearly_when_a_child_dies(state_file: Path) -> None:
    up = UpProcess(
        [
            "--model",
            "/nonexistent/model",
            "--engine",
            "torch",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--port",
            "0",
        ],
        state_file,
    )
    try:
        assert up.done.wait(60), up.output()
        rc = up.proc.wait(20)
        text = up.output()
        assert rc == 1, text
        assert "start-up failed" in text and "exited with status" in text
        assert not state_file.exists()
    finally:
        if up.proc.poll() is None:
            up.kill_tree()
