"""End to end over HTTP: real router, real workers (tiny), real nats-server, real UCX, and the
official openai client, against `fluidpd generate` as ground truth."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.support.nats_server import NatsServer, free_port
from tests.support.workers import REPO, start_worker, stop_all, worker_env

openai = pytest.importorskip("openai")


def _generate(prompt: str, max_tokens: int, chat: bool = False) -> dict:  # type: ignore[type-arg]
    cmd = [
        sys.executable,
        "-m",
        "services.cli.main",
        "generate",
        "--model",
        "tiny",
        "--prompt",
        prompt,
        "--max-tokens",
        str(max_tokens),
        "--json",
        "--ignore-eos",
    ]
    if chat:
        cmd.append("--chat")
    out = subprocess.run(cmd, check=True, capture_output=True, cwd=REPO, env=worker_env())
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


@pytest.fixture(scope="module")
def router_url(
    nats_server_module: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("http-logs")
    url = nats_server_module.url
    args = ("--model", "tiny", "--num-kv-blocks", "512", "--block-size", "4")
    workers = [
        start_worker("prefill", "p0", url, *args, log_dir=logs),
        start_worker("decode", "d0", url, *args, log_dir=logs),
    ]
    port = free_port()
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.router",
            "--nats",
            url,
            "--model",
            "tiny",
            "--port",
            str(port),
        ],
        cwd=REPO,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=open(logs / "router.log", "wb"),  # noqa: SIM115
    )
    try:
        assert router.stdout is not None
        line = router.stdout.readline().decode()  # blocks until the router is listening
        assert "router_ready" in line, line
        base = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x")
        import time

        deadline = time.monotonic() + 60
        import urllib.request

        while True:  # /health turns 200 once both workers registered
            try:
                with urllib.request.urlopen(f"{base}/health") as resp:
                    if resp.status == 200:
                        break
            except Exception:
                pass
            assert time.monotonic() < deadline, "cluster never became healthy"
            time.sleep(0.1)
        del client
        yield base
    finally:
        assert stop_all([router, *workers]) == [0, 0, 0]


def test_completions_match_generate(router_url: str) -> None:
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="x")
    want = _generate("Hello there, how are", 12)
    got = client.completions.create(
        model="tiny",
        prompt="Hello there, how are",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].text == want["text"]
    assert got.usage is not None and got.usage.completion_tokens == 12
    stream = client.completions.create(
        model="tiny",
        prompt="Hello there, how are",
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in stream) == want["text"]
    by_ids = client.completions.create(
        model="tiny",
        prompt=[5, 6, 7, 8],
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert by_ids.choices[0].finish_reason == "length"


def test_chat_matches_generate(router_url: str) -> None:
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="x")
    want = _generate("Say something", 10, chat=True)
    got = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say something"}],
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].message.content == want["text"]
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say something"}],
        max_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want["text"]


def test_fifty_concurrent_requests(router_url: str) -> None:
    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{router_url}/v1", api_key="x")
        outs = await asyncio.gather(
            *(
                client.completions.create(
                    model="tiny",
                    prompt=f"request {i}",
                    max_tokens=6,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                for i in range(50)
            )
        )
        await client.close()
        return [o.choices[0].finish_reason for o in outs]

    assert asyncio.run(run()) == ["length"] * 50


def test_bad_input_is_4xx(router_url: str) -> None:
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=3)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x" * 10, max_tokens=100000)
