"""Reference, end to end: smollm2-135m through real workers (disaggregated, FluidToken split at
beta 0.1/0.5/0.9, single worker) produces exactly `generate`'s greedy tokens — over the bus,
and over HTTP with the official openai client (completions and chat, stream and not)
against `fluidpd generate`'s text."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio

from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.generate import generate
from shared.sampling_params import SamplingParams
from tests.support.nats_server import NatsServer
from tests.support.workers import (
    BusClient,
    cli_generate,
    start_router,
    stop_all,
    wait_healthy,
    worker_pair,
)

pytestmark = [pytest.mark.reference, pytest.mark.asyncio(loop_scope="module")]
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
N = 16


@pytest.fixture(scope="module")
def cluster(
    nats_users_module: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("smollm2-logs")
    args = ("--model", "smollm2-135m", "--num-kv-blocks", "64", "--threads", "1")
    with worker_pair(nats_users_module, logs, *args) as url:
        yield url


@pytest.fixture(scope="module")
def routers(cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Two routers over the same workers: every prompt disaggregated / on D alone."""
    logs = tmp_path_factory.mktemp("smollm2-routers")
    procs, bases = [], {}
    try:
        for path, short in (("disaggregated", "0"), ("single", "100000")):
            args = ("--short-prompt-tokens", short)
            proc, bases[path] = start_router(
                cluster, "smollm2-135m", *args, log_dir=logs, name=f"router-{path}"
            )
            procs.append(proc)
        for base in bases.values():
            wait_healthy(base, timeout_s=120)
        yield bases
    finally:
        assert stop_all(procs) == [0] * len(procs)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(cluster: str) -> AsyncIterator[BusClient]:
    async with BusClient(cluster) as c:
        await c.wait_workers(["p0", "d0"], timeout_s=120)
        yield c


@pytest.fixture(scope="module")
def expected() -> list[tuple[list[int], list[int]]]:
    engine = Engine.load(EngineConfig(model="smollm2-135m", num_kv_blocks=64))
    tok = engine.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    outs = generate(engine, ids, SamplingParams(max_tokens=N, ignore_eos=True))
    return [(i, o.token_ids) for i, o in zip(ids, outs, strict=True)]


@pytest.mark.parametrize("beta", [None, 0.1, 0.5, 0.9])
async def test_disaggregated_and_split(client: BusClient, expected, beta) -> None:  # type: ignore[no-untyped-def]
    for prompt, want in expected:
        rid = await client.submit("p0", "d0", prompt, N, steal_ratio=beta)
        got = await client.result(rid, timeout_s=120)
        assert got.error is None and got.token_ids == want


async def test_single_worker(client: BusClient, expected) -> None:  # type: ignore[no-untyped-def]
    prompt, want = expected[0]
    rid = await client.submit("d0", "d0", prompt, N)
    assert (await client.result(rid, timeout_s=120)).token_ids == want


async def test_http_paths_match_fluidpd_generate(routers: dict[str, str]) -> None:
    openai = pytest.importorskip("openai")
    chat_msg, text_prompt = PROMPTS[0], "The capital of France is"
    want_chat, want_text = await asyncio.gather(
        asyncio.to_thread(cli_generate, "smollm2-135m", chat_msg, N, chat=True),
        asyncio.to_thread(cli_generate, "smollm2-135m", text_prompt, N),
    )
    extra = {"ignore_eos": True, "fluidpd_timestamps": True}
    messages: Any = [{"role": "user", "content": chat_msg}]
    for path, worker in (("disaggregated", "p0"), ("single", "d0")):
        api = openai.AsyncOpenAI(base_url=f"{routers[path]}/v1", api_key="x")
        try:
            chat = await api.chat.completions.create(
                model="smollm2-135m",
                messages=messages,
                max_tokens=N,
                temperature=0,
                extra_body=extra,
            )
            assert chat.choices[0].message.content == want_chat["text"], path
            assert chat.model_extra["fluidpd"]["prefill_worker"] == worker
            stream = await api.chat.completions.create(
                model="smollm2-135m",
                messages=messages,
                max_tokens=N,
                temperature=0,
                stream=True,
                extra_body=extra,
            )
            parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            assert "".join(parts) == want_chat["text"], path
            done = await api.completions.create(
                model="smollm2-135m",
                prompt=text_prompt,
                max_tokens=N,
                temperature=0,
                extra_body=extra,
            )
            assert done.choices[0].text == want_text["text"], path
            stream2 = await api.completions.create(
                model="smollm2-135m",
                prompt=text_prompt,
                max_tokens=N,
                temperature=0,
                stream=True,
                extra_body=extra,
            )
            assert "".join([c.choices[0].text async for c in stream2]) == want_text["text"], path
        finally:
            await api.close()


@pytest.mark.parametrize("beta", [None, 0.5])
async def test_logprobs_equal_engine_log_softmax(client: BusClient, beta: float | None) -> None:
    """Greedy tokens' logprobs and the prompt logprobs (echo) from the workers equal
    ``generate``'s log-softmax within 1e-4 — disaggregated (P scores the prompt and the
    first token), split (P the prefix, D the suffix and the first token) and D alone."""
    engine = Engine.load(EngineConfig(model="smollm2-135m", num_kv_blocks=64))
    tok = engine.tokenizer
    prompt = tok.encode("The capital of France is Paris, and the capital of Italy is")
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    want = generate(engine, [prompt], params)[0]
    targets = [("p0", beta)] if beta is not None else [("p0", None), ("d0", None)]
    for prefill_id, ratio in targets:
        rid = await client.submit(
            prefill_id, "d0", prompt, 4, steal_ratio=ratio, logprobs=3, prompt_logprobs=2
        )
        got = await client.result(rid, timeout_s=120)
        await client.wait_until(lambda g=got: len(g.prompt_logprobs) == len(prompt) - 1, 30)
        assert got.token_ids == want.token_ids
        for mine, ref in zip(got.logprobs, want.logprobs, strict=True):
            assert abs(mine.logprob - ref.logprob) < 1e-4
            assert mine.top_ids[0] == ref.top_ids[0]
            assert list(mine.top_logprobs) == sorted(mine.top_logprobs, reverse=True)
        for pos in range(1, len(prompt)):
            ref_p = want.prompt_logprobs[pos]
            assert ref_p is not None
            assert abs(got.prompt_logprobs[pos].logprob - ref_p.logprob) < 1e-4, (pos, ratio)
