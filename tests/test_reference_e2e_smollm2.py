"""Reference, end to end: smollm2-135m through real workers (disaggregated, FluidToken split at
beta 0.1/0.5/0.9, single worker) produces exactly `generate`'s greedy tokens."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.generate import generate
from shared.sampling_params import SamplingParams
from tests.support.nats_server import NatsServer
from tests.support.workers import BusClient, worker_pair

pytestmark = [pytest.mark.reference, pytest.mark.asyncio(loop_scope="module")]
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
N = 16


@pytest.fixture(scope="module")
def cluster(
    nats_server_module: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("smollm2-logs")
    args = ("--model", "smollm2-135m", "--num-kv-blocks", "64", "--threads", "1")
    with worker_pair(nats_server_module.url, logs, *args) as url:
        yield url


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
