"""End to end over HTTP: real routers, real workers (tiny), real nats-server, real UCX, and the
official openai client, against `fluidpd generate` as ground truth — through the
disaggregated path (prefill on P, KV over UCX, decode on D) and the single-worker path (a
router whose short-prompt threshold sends every prompt to D alone)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.nats_server import NatsServer
from tests.support.workers import (
    cli_generate,
    start_router,
    start_worker,
    stop_all,
    wait_healthy,
)

openai = pytest.importorskip("openai")


PATHS = {"disaggregated": "p0", "single": "d0"}  # path -> the worker that runs the prompt


@pytest.fixture(scope="module")
def routers(
    nats_users_module: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    """Base URLs by path: two routers over the same workers, differing only in
    ``--short-prompt-tokens`` (0: always disaggregated; 100000: always single-worker)."""
    logs = tmp_path_factory.mktemp("http-logs")
    url = nats_users_module
    args = ("--model", "tiny", "--num-kv-blocks", "512", "--block-size", "4")
    procs = [
        start_worker("prefill", "p0", url, *args, log_dir=logs),
        start_worker("decode", "d0", url, *args, log_dir=logs),
    ]
    try:
        bases = {}
        for path, short in (("disaggregated", "0"), ("single", "100000")):
            proc, bases[path] = start_router(
                url, "tiny", "--short-prompt-tokens", short, log_dir=logs, name=f"router-{path}"
            )
            procs.append(proc)
        for base in bases.values():
            wait_healthy(base)
        yield bases
    finally:
        assert stop_all(procs) == [0] * len(procs)


@pytest.fixture(scope="module")
def router_url(routers: dict[str, str]) -> str:
    return routers["disaggregated"]


def _ran_on(response: Any) -> str:
    """The worker that computed the prompt (the ``fluidpd_timestamps`` extension)."""
    return str((response.model_extra or {})["fluidpd"]["prefill_worker"])


@pytest.mark.parametrize("path", PATHS)
def test_completions_match_generate(routers: dict[str, str], path: str) -> None:
    client = openai.OpenAI(base_url=f"{routers[path]}/v1", api_key="x")
    want = cli_generate("tiny", "Hello there, how are", 12)
    extra = {"ignore_eos": True, "fluidpd_timestamps": True}
    got = client.completions.create(
        model="tiny", prompt="Hello there, how are", max_tokens=12, temperature=0, extra_body=extra
    )
    assert got.choices[0].text == want["text"]
    assert got.usage is not None and got.usage.completion_tokens == 12
    assert _ran_on(got) == PATHS[path]
    stream = client.completions.create(
        model="tiny",
        prompt="Hello there, how are",
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body=extra,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == want["text"]
    assert _ran_on(chunks[-1]) == PATHS[path]
    by_ids = client.completions.create(
        model="tiny",
        prompt=[5, 6, 7, 8],
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert by_ids.choices[0].finish_reason == "length"


@pytest.mark.parametrize("path", PATHS)
def test_chat_matches_generate(routers: dict[str, str], path: str) -> None:
    client = openai.OpenAI(base_url=f"{routers[path]}/v1", api_key="x")
    want = cli_generate("tiny", "Say something", 10, chat=True)
    messages: Any = [{"role": "user", "content": "Say something"}]
    extra = {"ignore_eos": True, "fluidpd_timestamps": True}
    got = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, extra_body=extra
    )
    assert got.choices[0].message.content == want["text"]
    assert _ran_on(got) == PATHS[path]
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True, extra_body=extra
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want["text"]
    assert _ran_on(next(c for c in reversed(chunks) if c.model_extra)) == PATHS[path]


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
