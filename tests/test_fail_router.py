"""Router failure paths (issue 17).

* A client that disconnects while ``Dispatcher.submit`` waits for the prefill worker's Ack
  (the worker is SIGSTOPped, so the Ack cannot come): the request is cancelled on both
  workers, whose free blocks come back at once instead of after the whole generation.
  Real processes (nats-server, router, emulated workers).
* Deeply nested JSON -> 400 (not a 500 RecursionError); fields we do not implement
  (``response_format``, ``logit_bias``, ``tools``, unknown names) -> 400 naming the field,
  neutral values of unimplemented fields accepted; large bodies are parsed, templated and
  tokenized off the event loop. A router in this process on a real nats-server, no
  workers: parsing happens before pairing, so a valid body gets 503 no_active_workers.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from services.common.cluster import Cluster
from services.router.app import PARSE_OFF_LOOP_BYTES, Router
from services.router.config import RouterConfig
from shared.bus import BusConfig
from shared.tokenizer import Tokenizer
from shared.tokenizer.models import load_tokenizer
from tests.support.faults import (
    Disconnect,
    completion,
    fault_cluster,
    leaked_blocks,
    prompt,
    serves_new_requests,
)
from tests.support.nats_server import NatsServer
from tests.support.workers import BusClient

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]


# ------------------------------------------------------------ disconnect during submit
@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("fail-router-logs")
    # Heartbeats every 2 s: p0 stays registered while it is stopped for ~1 s, so only the
    # client's disconnect can end the request (not the worker-lost path).
    with fault_cluster(logs, extra_worker_args=("--heartbeat-s", "2")) as c:
        yield c


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(cluster: Cluster) -> AsyncIterator[BusClient]:
    async with BusClient(cluster.operator_url) as c:
        await c.wait_workers(["p0", "d0"])
        yield c


async def test_disconnect_during_submit_cancels_on_both_workers(
    cluster: Cluster, client: BusClient
) -> None:
    assert await leaked_blocks(client, ["p0", "d0"]) == {}
    # 1500 output tokens take ~20 s: computed for nobody unless the cancel reaches both.
    cluster.kill_worker("p0", signal.SIGSTOP)
    try:
        async with aiohttp.ClientSession() as s:
            out = await completion(
                s, cluster.router_url, prompt(1, 2000), 1500, disconnect=Disconnect(after_s=0.5)
            )
    finally:
        cluster.kill_worker("p0", signal.SIGCONT)
    resumed_s = time.time()
    assert out.kind == "disconnected" and out.first_token_s is None, out
    # p0 runs again (fresh telemetry), so it has the request and the cancel by now...
    await client.wait_telemetry(lambda t: t["p0"].time_s > resumed_s, 10)

    # ...and it is never decoded: a prefill already running when the cancel came is
    # dropped after its step (and its admit cancelled on d0); without the cancel, d0
    # would decode it for ~20 s.
    with pytest.raises(TimeoutError):
        await client.wait_until(lambda: client.telemetry["d0"].running > 0, 3.0)
    assert await leaked_blocks(client, ["p0", "d0"], timeout_s=5.0) == {}
    new = await serves_new_requests(cluster.router_url)
    assert [o.kind for o in new] == ["completed"] * 2, new


# ------------------------------------------------------------------- body parsing
class ThreadSpyTokenizer:
    """The real tokenizer, recording which thread each encode ran on."""

    def __init__(self, inner: Tokenizer) -> None:
        self._inner = inner
        self.encode_threads: list[int] = []

    def encode(
        self, text: str, add_special_tokens: bool = False, *, release_gil: bool = False
    ) -> list[int]:
        self.encode_threads.append(threading.get_ident())
        return self._inner.encode(text, add_special_tokens, release_gil=release_gil)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.fixture(scope="module")
def nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path_factory.mktemp("fail-router-js"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def router(nats: NatsServer) -> AsyncIterator[tuple[Router, ThreadSpyTokenizer]]:
    spy = ThreadSpyTokenizer(load_tokenizer("tiny"))
    cfg = RouterConfig(
        port=0, bus=BusConfig.from_url(nats.url), subject_prefix="failrouter", model="tiny"
    )
    async with Router(cfg, tokenizer=spy) as r:  # type: ignore[arg-type]
        yield r, spy


async def _post(url: str, data: bytes) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(url, data=data) as r:
        return r.status, await r.json()


async def test_deeply_nested_json_is_a_400(router: tuple[Router, ThreadSpyTokenizer]) -> None:
    r, _ = router
    for path in ("/v1/completions", "/v1/chat/completions"):
        for body in (
            b"[" * 200_000,
            b'{"a":' * 100_000,
            b'{"model":"tiny","prompt":' + b"[" * 50_000,
        ):
            status, payload = await _post(r.url + path, body)
            assert status == 400, (path, payload)
            assert payload["error"]["code"] == "invalid_request_error", payload
    # Nested, but within the parser's limit: a clear 400 from validation.
    nested = '{"model":"tiny","prompt":' + "[" * 500 + "1" + "]" * 500 + "}"
    status, payload = await _post(r.url + "/v1/completions", nested.encode())
    assert status == 400 and payload["error"]["param"] == "prompt", payload
    assert r.bus is not None and r.bus.is_connected  # still serving


UNSUPPORTED = [
    ("completion", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("completion", {"logit_bias": {"17": 100}}, "logit_bias"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"tool_choice": "auto"}, "tool_choice"),
    ("completion", {"suffix": "x"}, "suffix"),
    ("chat", {"echo": True}, "echo"),  # a completions field
    ("completion", {"top_logprobs": 3}, "top_logprobs"),  # a chat field
    ("completion", {"frequency_penalty": 0.5}, "frequency_penalty"),
    ("completion", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("chat", {"prompt": "hi"}, "prompt"),
    ("chat", {"frobnicate": 1}, "frobnicate"),
]


@pytest.mark.parametrize(("kind", "extra", "param"), UNSUPPORTED)
async def test_unsupported_fields_are_refused(
    router: tuple[Router, ThreadSpyTokenizer], kind: str, extra: dict[str, Any], param: str
) -> None:
    r, _ = router
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 4, **extra}
    if kind == "chat" and "messages" not in body:
        body["messages"] = [{"role": "user", "content": "hi"}]
    if kind == "completion" and "prompt" not in body:
        body["prompt"] = "hi"
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    status, payload = await _post(r.url + path, json.dumps(body).encode())
    assert status == 400, payload
    err = payload["error"]
    assert err["param"] == param and err["code"] == "unsupported_parameter", err
    assert param in err["message"], err


async def test_neutral_values_of_unimplemented_fields_pass(
    router: tuple[Router, ThreadSpyTokenizer],
) -> None:
    r, _ = router
    body = {
        "model": "tiny",
        "prompt": "hi",
        "n": 1,
        "echo": False,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "user": "u1",
        "response_format": None,
    }
    status, payload = await _post(r.url + "/v1/completions", json.dumps(body).encode())
    # Parsed and accepted; nothing to serve it in this test.
    assert status == 503 and payload["error"]["code"] == "no_active_workers", payload


async def test_large_bodies_are_parsed_off_the_event_loop(
    router: tuple[Router, ThreadSpyTokenizer],
) -> None:
    r, spy = router
    loop_thread = threading.get_ident()  # the router runs on this test's loop
    text = "hello world " * (PARSE_OFF_LOOP_BYTES // 12 + 10)
    for path, body in (
        ("/v1/completions", {"model": "tiny", "prompt": text}),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": text}]},
        ),
    ):
        spy.encode_threads.clear()
        status, payload = await _post(r.url + path, json.dumps(body).encode())
        assert status == 503, payload  # parsed fully (pairing comes after)
        assert spy.encode_threads and loop_thread not in spy.encode_threads
    spy.encode_threads.clear()
    status, _ = await _post(
        r.url + "/v1/completions", json.dumps({"model": "tiny", "prompt": "hi"}).encode()
    )
    assert status == 503 and spy.encode_threads == [loop_thread]  # small: inline
