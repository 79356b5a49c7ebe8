"""NATS as a trust boundary, with real processes and a real nats-server.

One `fluidpd up` (emulated engine, auth on by default, an API key in its environment):
no credentials → no connection; the router's credentials cannot switch a worker or pause
the policy; a worker's cannot speak for another worker; forged token items and epochs
change no stream; the API key guards /v1/*. Plus: a worker without a cluster secret exits
2 with one line; a worker and a client reach a TLS-only nats-server with the CA only.
Clients speak the NATS wire protocol (tests/support/nats_wire.py), as the NATS CLI would.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from services.common.cluster import Cluster
from services.common.cluster_spec import ClusterSpec
from services.common.nats_auth import permissions
from services.common.nats_server import find_nats_server_binary, free_port
from shared.bus import Bus, BusConfig, BusConnectionError
from shared.messages import SequenceTracker, Subjects, TokenBatch, TokenItem, encode
from shared.messages.sequence import MAX_EPOCH_AHEAD_NS
from tests.support.nats_wire import WireError, ping, raw_publish, raw_request, raw_subscribe
from tests.support.up_process import UpProcess
from tests.support.workers import REPO, worker_env

pytestmark = pytest.mark.timeout(180)
API_KEY = "sk-test-7d1f0c"
SUBJECTS = Subjects()
HOST = "127.0.0.1"
N_TOKENS = 40  # the forged-stream request; ~10 ms per token at --time-scale 20


# ------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[UpProcess, dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("trust")
    state_file = tmp / "up.json"
    args = ["--model", "tiny", "--engine", "emulated", "--prefill", "1", "--decode", "1"]
    args += ["--port", "0", "--time-scale", "20", "--log-dir", str(tmp / "logs")]
    proc = UpProcess(args, state_file, FLUIDPD_API_KEY=API_KEY)
    try:
        proc.wait_ready(120)
        yield proc, json.loads(state_file.read_text())
    finally:
        if proc.proc.poll() is None:
            proc.kill_tree()


def _port(state: dict[str, Any]) -> int:
    return int(state["nats_url"].rsplit(":", 1)[1])


def _child_credentials(state: dict[str, Any], child: str) -> tuple[str, str]:
    """The NATS user of one child, as that process holds it (its environment)."""
    raw = Path(f"/proc/{state['pids'][child]}/environ").read_bytes().split(b"\0")
    env = dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)
    return env["FLUIDPD_NATS_USER"], env["FLUIDPD_NATS_PASSWORD"]


def _http(
    url: str, body: dict[str, Any] | None = None, key: str | None = None
) -> tuple[int, dict[str, Any] | str]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, raw = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read().decode()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def _violations(errors: list[str]) -> bool:
    return any("Permissions Violation" in e for e in errors)


# ------------------------------------------------------------------ permissions (unit)
def test_permission_lists_come_from_the_subjects() -> None:
    router = permissions("router", SUBJECTS)
    assert SUBJECTS.worker_prefill("*") in router.publish
    assert not any(p.endswith(".switch") or "controller" in p for p in router.publish)
    worker = permissions("worker", SUBJECTS, "p0")
    assert SUBJECTS.telemetry("*", "p0") in worker.publish
    assert SUBJECTS.events("p0") in worker.publish
    assert not any("d0" in p or p.endswith(".switch") for p in worker.publish)
    assert SUBJECTS.worker_switch("p0") in worker.subscribe  # its own commands only
    assert SUBJECTS.worker_switch("*") not in worker.subscribe
    assert permissions("operator", SUBJECTS).publish == (">",)
    with pytest.raises(ValueError):
        permissions("admin", SUBJECTS)


def test_stream_subjects_name_their_publisher() -> None:
    tokens = SUBJECTS.router_tokens("r1")
    assert SUBJECTS.tokens_from(tokens, "d0") == "fluidpd.router.r1.tokens.d0"
    assert SUBJECTS.publisher_of(SUBJECTS.tokens_from(tokens, "d0")) == "d0"
    assert SUBJECTS.publisher_of(SUBJECTS.telemetry("decode", "d0")) == "d0"
    assert SUBJECTS.publisher_of(SUBJECTS.events("p1")) == "p1"
    assert SUBJECTS.publisher_of(SUBJECTS.controller_decisions()) is None
    for bad in ("fluidpd.worker.d0.switch", "fluidpd.router.*.tokens", "other.router.r.tokens"):
        with pytest.raises(ValueError):
            SUBJECTS.tokens_from(bad, "d0")


def test_future_epochs_are_dropped() -> None:
    now_ns = 10**18
    tracker = SequenceTracker(clock_ns=lambda: now_ns)
    assert tracker.observe("d0", now_ns - 5, 0).accepted
    assert not tracker.observe("d0", now_ns + MAX_EPOCH_AHEAD_NS + 1, 0).accepted
    assert tracker.observe("d0", now_ns - 5, 1).accepted  # the real stream goes on
    assert tracker.observe("d0", now_ns + 1, 0).restarted  # a restart within the skew


# --------------------------------------------------------------- fluidpd up (processes)
def test_state_file_is_private(up: tuple[UpProcess, dict[str, Any]]) -> None:
    proc, state = up
    mode = stat.S_IMODE(Path(proc.env["FLUIDPD_STATE_FILE"]).stat().st_mode)
    assert mode == 0o600 and state["nats_user"] == "operator" and state["nats_password"]


def test_no_credentials_cannot_connect(up: tuple[UpProcess, dict[str, Any]]) -> None:
    _, state = up
    port = _port(state)
    for user, password in ((None, None), ("operator", "wrong"), ("nobody", "x")):
        with pytest.raises(WireError, match="Authorization Violation"):
            ping(HOST, port, user=user, password=password)
    ping(HOST, port, user=state["nats_user"], password=state["nats_password"])  # control


def test_router_cannot_switch_workers_or_pause_the_policy(
    up: tuple[UpProcess, dict[str, Any]],
) -> None:
    proc, state = up
    port, creds = _port(state), _child_credentials(state, "router")
    user, password = creds
    for subject, body in (
        (SUBJECTS.worker_switch("d0"), b'{"role":"prefill"}'),
        (SUBJECTS.worker_switch("*"), b'{"role":"prefill"}'),
        (SUBJECTS.controller_policy(), b'{"auto":false}'),
    ):
        errors = raw_publish(HOST, port, subject, body, user=user, password=password)
        assert _violations(errors), (subject, errors)
    # Nor read what is not its own: other users' replies, the workers' requests.
    for subject in ("_INBOX.>", "_INBOX_controller.>", SUBJECTS.worker_prefill("p0")):
        errors = raw_subscribe(HOST, port, subject, user=user, password=password)
        assert _violations(errors), (subject, errors)
    assert raw_subscribe(HOST, port, "_INBOX_router.>", user=user, password=password) == []
    # Control: what a router must do is allowed (a cancel of an unknown id is ignored).
    cancel = b'{"request_id":"none","reason":"test"}'
    assert (
        raw_publish(HOST, port, SUBJECTS.worker_cancel("d0"), cancel, user=user, password=password)
        == []
    )
    # Nothing changed: d0 still decodes and the policy is still automatic.
    ctl = subprocess.run(
        [sys.executable, "-m", "services.cli.ctl", "status", "--json"],
        env=proc.env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ctl.returncode == 0, ctl.stderr  # no flag: the operator creds of the state file
    rows = {r["id"]: r for r in json.loads(ctl.stdout)}
    assert rows["d0"]["role"] == "decode" and rows["d0"]["state"] == "active"


def test_worker_cannot_speak_for_another(up: tuple[UpProcess, dict[str, Any]]) -> None:
    _, state = up
    port = _port(state)
    user, password = _child_credentials(state, "p0")
    assert user == "worker-p0"
    for subject in (
        SUBJECTS.telemetry("decode", "d0"),
        SUBJECTS.events("d0"),
        SUBJECTS.tokens_from(SUBJECTS.router_tokens("r1"), "d0"),
        SUBJECTS.worker_switch("d0"),
        SUBJECTS.controller_policy(),
        SUBJECTS.controller_status(),
        SUBJECTS.registry_key("d0"),
    ):
        errors = raw_publish(HOST, port, subject, b"{}", user=user, password=password)
        assert _violations(errors), (subject, errors)
    for subject in (SUBJECTS.worker_prefill("d0"), SUBJECTS.worker_admit("*"), "_INBOX.>"):
        errors = raw_subscribe(HOST, port, subject, user=user, password=password)
        assert _violations(errors), (subject, errors)  # no other worker's prompts or replies
    # Its own event subject is allowed (the payload is invalid: receivers drop it).
    assert raw_publish(HOST, port, SUBJECTS.events("p0"), b"{}", user=user, password=password) == []


def test_operator_can_pause_and_resume(up: tuple[UpProcess, dict[str, Any]]) -> None:
    _, state = up
    creds = {"user": state["nats_user"], "password": state["nats_password"]}
    for auto in (False, True):
        body = json.dumps({"auto": auto}).encode()
        reply = json.loads(
            raw_request(HOST, _port(state), SUBJECTS.controller_policy(), body, **creds)
        )
        assert reply["ok"] is True and reply["auto"] is auto


def test_api_key_guards_the_openai_routes(up: tuple[UpProcess, dict[str, Any]]) -> None:
    base = _router_url(up)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
    for key in (None, "wrong", ""):
        status, reply = _http(base + "/v1/completions", body, key)
        assert status == 401, reply
        assert isinstance(reply, dict) and reply["error"]["code"] == "invalid_api_key"
    status, reply = _http(base + "/v1/models")
    assert status == 401, reply
    assert _http(base + "/v1/completions", body, API_KEY)[0] == 200
    assert _http(base + "/v1/models", key=API_KEY)[0] == 200
    for path in ("/health", "/metrics"):  # open, as in vLLM: probes and scrapers
        assert _http(base + path)[0] == 200


def _router_url(up: tuple[UpProcess, dict[str, Any]]) -> str:
    return str(up[1]["router_url"])


async def _stream(base: str, body: dict[str, Any], on_first: Any) -> tuple[str, str | None, int]:
    """Stream a completion; call ``on_first(request_id)`` after the first token. Returns
    the text, the finish reason and how many chunks with text came after ``on_first``."""
    text, finish, first, after = "", None, True, 0
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(base + "/v1/completions", json=body, headers=headers) as resp,
    ):
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choice = chunk["choices"][0] if chunk["choices"] else {}
            text += choice.get("text") or ""
            finish = choice.get("finish_reason") or finish
            after += bool(choice.get("text")) and not first
            if first and choice.get("text"):
                first = False
                await on_first(chunk["id"].removeprefix("cmpl-"))
    return text, finish, after


def test_forged_token_items_and_epochs_change_no_stream(
    up: tuple[UpProcess, dict[str, Any]],
) -> None:
    base, state = _router_url(up), up[1]
    body = {"model": "tiny", "prompt": "one two three", "max_tokens": N_TOKENS, "ignore_eos": True}
    body["seed"] = 1234
    status, control = _http(base + "/v1/completions", body, API_KEY)
    assert status == 200 and isinstance(control, dict), control
    asyncio.run(_forge_during_stream(base, state, body, control["choices"][0]["text"]))


async def _forge_during_stream(
    base: str, state: dict[str, Any], body: dict[str, Any], expected: str
) -> None:
    cfg = BusConfig.from_url(
        state["nats_url"], user=state["nats_user"], password=state["nats_password"]
    )
    async with Bus(cfg, SUBJECTS) as bus:  # the operator may publish anything
        routers: list[str] = []

        async def seen(msg: Any) -> None:
            routers.append(msg.subject.split(".")[2])

        sub = await bus.nc.subscribe(SUBJECTS.router_tokens_in("*"), cb=seen)
        warm = {**body, "max_tokens": 2, "seed": 1}
        assert (await asyncio.to_thread(_http, base + "/v1/completions", warm, API_KEY))[0] == 200
        await bus.flush()
        await sub.unsubscribe()
        tokens = SUBJECTS.router_tokens(routers[0])
        future_epoch = time.time_ns() + 3600 * 10**9
        forged = 0

        async def forge(
            publisher_subject: str, publisher_id: str, epoch: int, items: tuple[TokenItem, ...]
        ) -> None:
            nonlocal forged
            batch = TokenBatch(publisher_id=publisher_id, epoch=epoch, seq=0, items=items)
            await bus.nc.publish(SUBJECTS.tokens_from(tokens, publisher_subject), encode(batch))
            forged += 1

        # Before the request: a far-future epoch for each real worker (would silence both).
        for worker_id in ("p0", "d0"):
            await forge(worker_id, worker_id, future_epoch, ())

        async def on_first(request_id: str) -> None:
            evil = (
                *(
                    TokenItem(request_id=request_id, index=i, token_ids=(7,))
                    for i in range(1, N_TOKENS)
                ),
                TokenItem(
                    request_id=request_id, index=N_TOKENS - 1, finish_reason="error", error="x"
                ),
            )
            await forge("zz", "zz", time.time_ns(), evil)  # not a worker of this request
            await forge("d0", "p0", time.time_ns(), evil)  # publisher != the subject's id
            await forge("d0", "d0", future_epoch + 1, evil)  # the real D, a future epoch
            await bus.flush()

        text, finish, after = await _stream(base, {**body, "stream": True}, on_first)
    assert forged == 5 and after >= 5  # the forgeries went out while the stream ran
    assert finish == "length" and text == expected
    metrics = (await asyncio.to_thread(_http, base + "/metrics"))[1]
    assert isinstance(metrics, str)
    assert _metric(metrics, "fluidpd_router_foreign_token_items_total") >= N_TOKENS
    assert _metric(metrics, 'outcome="forged"') >= 1


def _metric(text: str, needle: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if needle in line and not line.startswith("#")
    )


def test_a_replacement_worker_gets_its_own_user(tmp_path: Path) -> None:
    """Cluster.add_worker with a new id adds its user to the running nats-server (reload)."""
    spec = ClusterSpec(
        prefill=1, decode=0, model="tiny", engine="emulated", nats_auth=True,
        with_controller=False, with_router=False, log_dir=tmp_path,
    )  # fmt: skip
    cluster = Cluster(spec)
    try:
        cluster.start()
        cluster.add_worker("p7", "prefill")  # not in the spec: a reload adds its user
        cluster.wait_ready(90)  # p0 and p7 logged in with their own users and registered
        state = {"pids": cluster.pids()}
        assert _child_credentials(state, "p7")[0] == "worker-p7"
        port = int(cluster.nats_url.rsplit(":", 1)[1])
        with pytest.raises(WireError, match="Authorization Violation"):
            ping(HOST, port)
    finally:
        cluster.stop()


# ------------------------------------------------------------------------ secrets, TLS
def test_worker_without_cluster_secret_exits_2_with_one_line() -> None:
    env = worker_env()
    env.pop("FLUIDPD_CLUSTER_SECRET")
    cmd = [sys.executable, "-m", "services.decode_worker", "--id", "nosecret"]
    cmd += ["--model", "tiny", "--engine", "emulated", "--nats", f"nats://{HOST}:1"]
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "FLUIDPD_CLUSTER_SECRET" in lines[0] and "Traceback" not in out.stdout + out.stderr


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_certs(d: Path) -> None:
    """A test CA and a server certificate for 127.0.0.1 / localhost (EC P-256, 1 day)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=fluidpd-test-ca", cwd=d)  # fmt: skip
    _openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost",
             cwd=d)  # fmt: skip
    (d / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "server.pem", "-days", "1", "-extfile", "ext.cnf",
             cwd=d)  # fmt: skip


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_tls_only_server_reached_with_the_ca(tmp_path: Path) -> None:
    _make_certs(tmp_path)
    port = free_port()
    conf = {
        "host": HOST,
        "port": port,
        "jetstream": {"store_dir": str(tmp_path / "js")},
        "tls": {
            "cert_file": str(tmp_path / "server.pem"),
            "key_file": str(tmp_path / "server.key"),
        },
    }
    (tmp_path / "nats.conf").write_text(json.dumps(conf))
    server = subprocess.Popen(
        [str(find_nats_server_binary()), "-c", str(tmp_path / "nats.conf")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    worker: subprocess.Popen[str] | None = None
    try:
        assert server.stderr is not None
        _wait_line(server.stderr, "Server is ready", 20)
        url = f"tls://{HOST}:{port}"
        cmd = [sys.executable, "-m", "services.decode_worker", "--id", "dtls", "--nats", url]
        cmd += [
            "--model",
            "tiny",
            "--engine",
            "emulated",
            "--nats-tls-ca",
            str(tmp_path / "ca.pem"),
        ]
        worker = subprocess.Popen(
            cmd,
            env=worker_env(),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert worker.stdout is not None
        _wait_line(worker.stdout, "worker_ready", 90)  # registered over TLS (JetStream KV)
        asyncio.run(_tls_clients(url, tmp_path / "ca.pem"))
    finally:
        for p in (worker, server):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(15)


async def _tls_clients(url: str, ca: Path) -> None:
    plain = BusConfig.from_url(url.replace("tls://", "nats://"), initial_connect_deadline_s=3.0)
    with pytest.raises(BusConnectionError):
        async with Bus(plain, SUBJECTS):
            pass
    async with Bus(BusConfig.from_url(url, tls_ca_file=str(ca)), SUBJECTS) as bus:
        kv = await bus.jetstream().key_value(SUBJECTS.registry_bucket())
        assert (await kv.get("dtls")).value  # the TLS worker's registry record


def _wait_line(stream: Any, needle: str, timeout_s: float) -> None:
    """Read ``stream`` (a thread) until a line contains ``needle``; raise on EOF/timeout."""
    found, lines = threading.Event(), []

    def read() -> None:  # keeps draining after the line, so the child never blocks
        for line in stream:
            lines.append(line)
            if needle in line:
                found.set()

    threading.Thread(target=read, daemon=True).start()
    assert found.wait(timeout_s), "".join(lines[-30:])
