"""Logprobs, echo and n > 1 end to end over HTTP (real router, real workers on tiny, real
nats-server and UCX, the official openai client) against ``fluidpd generate --logprobs``,
on the disaggregated path, a forced FluidToken split (P scores the prefix, D the suffix and
the first token) and the single-worker path."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio

from services.common.nats_auth import generate_users
from shared.messages.subjects import Subjects
from tests.support.fixtures import TEST_WORKER_IDS
from tests.support.nats_server import NatsServer
from tests.support.workers import (
    REPO,
    BusClient,
    client_url,
    start_router,
    start_worker,
    stop_all,
    wait_healthy,
    worker_env,
)

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "Hello there, how are you doing on this"
TOL = 1e-4
MAX_MODEL_LEN = 96  # --max-model-len on the workers (tiny's own limit is larger)


@dataclass
class Cluster:
    nats_url: str
    routers: dict[str, str]  # path -> base URL


@pytest.fixture(scope="module", params=["disaggregated", "split"])
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp(f"lp-{request.param}")
    server = NatsServer(
        tmp_path_factory.mktemp("nats-lp"), users=generate_users(Subjects(), TEST_WORKER_IDS)
    )
    server.start()
    args = ["--model", "tiny", "--num-kv-blocks", "256", "--block-size", "4"]
    args += ["--max-model-len", str(MAX_MODEL_LEN)]
    if request.param == "split":
        args += ["--force-steal-ratio", "0.5"]  # every prompt split: P half, D half
    procs = [
        start_worker("prefill", "p0", server, *args, log_dir=logs),
        start_worker("decode", "d0", server, *args, log_dir=logs),
    ]
    try:
        paths = {request.param: "0"}
        if request.param == "disaggregated":
            paths["single"] = "100000"
        routers = {}
        for path, short in paths.items():
            proc, routers[path] = start_router(
                server, "tiny", "--short-prompt-tokens", short, log_dir=logs, name=path
            )
            procs.append(proc)
        for base in routers.values():
            wait_healthy(base)
        yield Cluster(client_url(server), routers)
    finally:
        codes = stop_all(procs)
        server.stop()
        assert codes == [0] * len(procs)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def bus(cluster: Cluster) -> AsyncIterator[BusClient]:
    async with BusClient(cluster.nats_url) as c:
        await c.wait_workers(["p0", "d0"])
        yield c


def _generate(prompt: str, max_tokens: int, k: int, chat: bool = False) -> Any:
    cmd = [sys.executable, "-m", "services.cli.main", "generate", "--model", "tiny"]
    cmd += ["--prompt", prompt, "--max-tokens", str(max_tokens), "--json", "--ignore-eos"]
    cmd += ["--logprobs", str(k)] + (["--chat"] if chat else [])
    out = subprocess.run(cmd, check=True, capture_output=True, cwd=REPO, env=worker_env())
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


@pytest.fixture(scope="module")
def want() -> Any:
    return _generate(PROMPT, 6, 3)


@pytest.fixture(scope="module")
def want_chat() -> Any:
    return _generate("Say something", 5, 2, chat=True)


async def _all_blocks_free(bus: BusClient) -> None:
    await bus.wait_telemetry(
        lambda t: all(
            t.get(w) and t[w].free_blocks == t[w].total_blocks and t[w].running == 0
            for w in ("p0", "d0")
        )
    )


def _check_top(top: dict[str, float] | list[Any], chosen: float) -> None:
    values = list(top.values()) if isinstance(top, dict) else [t.logprob for t in top]
    assert all(v <= 0 for v in values)
    assert max(values) >= chosen - TOL


async def test_completion_logprobs_and_echo_match_generate(
    cluster: Cluster, bus: BusClient, want: Any
) -> None:
    for path, base in cluster.routers.items():
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x")
        got = await client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            logprobs=3,
            echo=True,
            extra_body={"ignore_eos": True},
        )
        lp = got.choices[0].logprobs
        assert lp is not None, path
        n_prompt = len(want["prompt_token_ids"])
        assert len(lp.tokens) == n_prompt + 6
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # echo: first
        for i, ref in enumerate(want["prompt_logprobs"][1:], start=1):
            assert abs(lp.token_logprobs[i] - ref["logprob"]) < TOL, (path, i)
        for i, ref in enumerate(want["logprobs"]):
            value = lp.token_logprobs[n_prompt + i]
            assert abs(value - ref["logprob"]) < TOL, (path, i)
            top = lp.top_logprobs[n_prompt + i]
            # Greedy: the chosen token is the most likely one; top-3 listed (dict by text).
            assert abs(max(top.values()) - value) < TOL
            _check_top(top, value)
        assert got.choices[0].text.startswith(PROMPT)
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    if "split" in cluster.routers:
        # The split path really split (D computed a suffix): its counter shows in the next
        # telemetry period, not necessarily the one already received.
        await bus.wait_telemetry(
            lambda t: "d0" in t and t["d0"].metrics.get("decode_stolen_tokens_total", 0) > 0, 10.0
        )
    await _all_blocks_free(bus)


async def test_streamed_completion_logprobs(cluster: Cluster, bus: BusClient, want: Any) -> None:
    for path, base in cluster.routers.items():
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x")
        stream = await client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            logprobs=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        values: list[float] = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs is not None:
                values.extend(chunk.choices[0].logprobs.token_logprobs)
        assert len(values) == 6, path
        for v, ref in zip(values, want["logprobs"], strict=True):
            assert abs(v - ref["logprob"]) < TOL, path
    await _all_blocks_free(bus)


async def test_chat_logprobs_stream_and_not(
    cluster: Cluster, bus: BusClient, want_chat: Any
) -> None:
    messages: Any = [{"role": "user", "content": "Say something"}]
    refs = [r["logprob"] for r in want_chat["logprobs"]]
    for path, base in cluster.routers.items():
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x")
        common: Any = {
            "model": "tiny",
            "messages": messages,
            "max_tokens": 5,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
            "extra_body": {"ignore_eos": True},
        }
        got = await client.chat.completions.create(**common)
        content = got.choices[0].logprobs.content
        assert [abs(c.logprob - r) < TOL for c, r in zip(content, refs, strict=True)] == [True] * 5
        for c in content:
            assert len(c.top_logprobs) == 2
            tops = [t.logprob for t in c.top_logprobs]
            assert tops == sorted(tops, reverse=True) and abs(tops[0] - c.logprob) < TOL
            assert c.top_logprobs[0].token == c.token and c.bytes == list(c.token.encode())
        stream = await client.chat.completions.create(**common, stream=True)
        chunks = [chunk async for chunk in stream if chunk.choices]
        # The role chunk carries no token, so no logprob; each token's logprob comes with
        # the chunk that carries its text (the router holds the headers until the first
        # token, so the role chunk goes out after that token arrived).
        assert chunks[0].choices[0].delta.role == "assistant", path
        assert not chunks[0].choices[0].delta.content, path
        assert not (chunks[0].choices[0].logprobs and chunks[0].choices[0].logprobs.content)
        first_text = next(c.choices[0] for c in chunks[1:] if c.choices[0].delta.content)
        assert first_text.logprobs and first_text.logprobs.content, path
        streamed = [
            c.logprob
            for chunk in chunks
            if chunk.choices[0].logprobs
            for c in chunk.choices[0].logprobs.content or []
        ]
        assert [abs(s - r) < TOL for s, r in zip(streamed, refs, strict=True)] == [True] * 5, path
    await _all_blocks_free(bus)


async def test_n3_seeded_is_distinct_reproducible_and_frees_blocks(
    cluster: Cluster, bus: BusClient
) -> None:
    base = next(iter(cluster.routers.values()))
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x")

    async def ask() -> list[str]:
        got = await client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=12,
            temperature=1.0,
            n=3,
            seed=1234,
            extra_body={"ignore_eos": True},
        )
        assert [c.index for c in got.choices] == [0, 1, 2]
        assert got.usage is not None and got.usage.completion_tokens == 36
        return [c.text for c in got.choices]

    first = await ask()
    assert len(set(first)) == 3  # each choice has its own seed
    assert await ask() == first  # ... derived from the request's: reproducible
    stream = await client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=12,
        temperature=1.0,
        n=3,
        seed=1234,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    streamed = ["", "", ""]
    async for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == first  # the same three choices, streamed interleaved
    # best_of 3, n 1: the one of those three samples with the highest cumulative logprob.
    scored = await client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=12,
        temperature=1.0,
        n=3,
        seed=1234,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    totals = {c.text: sum(c.logprobs.token_logprobs) for c in scored.choices}
    best = await client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=12,
        temperature=1.0,
        n=1,
        best_of=3,
        seed=1234,
        extra_body={"ignore_eos": True},
    )
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == max(totals, key=totals.__getitem__)
    await _all_blocks_free(bus)


async def test_max_model_len_is_reported_and_enforced(cluster: Cluster) -> None:
    base = next(iter(cluster.routers.values()))
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x")
    models = await client.models.list()
    assert (models.data[0].model_extra or {})["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(
            model="tiny", prompt=[5] * (MAX_MODEL_LEN - 4), max_tokens=8, temperature=0
        )
    assert info.value.code == "context_length_exceeded"
    assert f"maximum context length is {MAX_MODEL_LEN}" in str(info.value)


async def test_vllm_named_metrics(cluster: Cluster) -> None:
    """vLLM's metric names with ``model_name``, counted; the gauges back to 0 at the end."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    base = next(iter(cluster.routers.values()))
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x")
    await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=3, extra_body={"ignore_eos": True}
    )
    with urllib.request.urlopen(f"{base}/metrics") as resp:
        text = resp.read().decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    tiny = (("model_name", "tiny"),)
    assert samples[("vllm:time_to_first_token_seconds_count", tiny)] >= 1
    assert samples[("vllm:e2e_request_latency_seconds_count", tiny)] >= 1
    assert samples[("vllm:time_per_output_token_seconds_count", tiny)] >= 1
    assert samples[("vllm:generation_tokens_total", tiny)] >= 1
    assert samples[("vllm:request_success_total", (("finished_reason", "length"), *tiny))] >= 1
    # Nothing in flight now: both gauges back to zero.
    assert samples[("vllm:num_requests_running", tiny)] == 0
    assert samples[("vllm:num_requests_waiting", tiny)] == 0
    assert "fluidpd_router_ttft_seconds_count" in text  # ours stay


async def test_lm_eval_style_loglikelihood_request(cluster: Cluster, want: Any) -> None:
    """What lm-evaluation-harness sends for log-likelihood: token ids, max_tokens 1, echo,
    logprobs 1 — the request ends at its first token (on the disaggregated path that is
    P's token; D only reports the end)."""
    ids = want["prompt_token_ids"]
    for path, base in cluster.routers.items():
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", timeout=60)
        got = await client.completions.create(
            model="tiny", prompt=[ids], max_tokens=1, temperature=0, logprobs=1, echo=True, seed=1
        )
        choice = got.choices[0]
        assert choice.finish_reason == "length", path
        lp = choice.logprobs
        assert lp is not None and len(lp.token_logprobs) == len(ids) + 1
        ctx = [lp.token_logprobs[i] for i in range(1, len(ids))]
        refs = [r["logprob"] for r in want["prompt_logprobs"][1:]]
        assert all(abs(a - b) < TOL for a, b in zip(ctx, refs, strict=True)), path
        assert abs(lp.token_logprobs[-1] - want["logprobs"][0]["logprob"]) < TOL
        plain = await client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=2, temperature=0, echo=True
        )
        assert plain.choices[0].text.startswith(PROMPT) and plain.choices[0].logprobs is None
