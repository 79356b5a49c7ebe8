"""Small KV pools on real workers (tiny model, real nats-server and UCX): a decode pool that
runs dry while decoding ends one request clearly and the others finish (no hang); a prefill
worker whose blocks are still held by KV exports waits for them instead of failing."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.generate import generate
from shared.sampling_params import SamplingParams
from tests.support.nats_server import NatsServer
from tests.support.workers import BusClient, worker_pair

pytestmark = pytest.mark.asyncio(loop_scope="module")
BLOCK = 4
NUM_BLOCKS = 64  # per worker; the prefill role lends 1/8 of it to its workspace
RESERVE_TOKENS = 8  # decode horizon reserved at admission; longer outputs grow while decoding


@pytest.fixture(scope="module")
def cluster(
    nats_users_module: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("pool-logs")
    args = ("--model", "tiny", "--num-kv-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK))
    args += ("--decode-reserve-tokens", str(RESERVE_TOKENS), "--no-fluidtoken")
    with worker_pair(nats_users_module, logs, *args) as url:
        yield url


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(cluster: str) -> AsyncIterator[BusClient]:
    async with BusClient(cluster) as c:
        await c.wait_workers(["p0", "d0"])
        yield c


@pytest.fixture(scope="module")
def reference() -> Engine:
    return Engine.load(EngineConfig(model="tiny", block_size=BLOCK, num_kv_blocks=512))


def _prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(length)] for _ in range(n)]


async def _idle(client: BusClient) -> None:
    await client.wait_telemetry(
        lambda t: all(
            t.get(w) and t[w].free_blocks == t[w].total_blocks and t[w].running == 0
            for w in ("p0", "d0")
        ),
        30.0,
    )


async def test_decode_pool_running_dry_ends_one_request_and_the_rest_finish(
    client: BusClient, reference: Engine
) -> None:
    # Each request grows to (10 + 100) / 4 = 28 blocks: three need 84 of d0's 64, two fit.
    prompts = _prompts(3, 10, 1, reference.model_config.vocab_size)
    want = generate(reference, prompts, SamplingParams(max_tokens=100, ignore_eos=True))
    rids = await asyncio.gather(*(client.submit("p0", "d0", p, 100) for p in prompts))
    got = [await client.result(r, timeout_s=60) for r in rids]
    errors = [g for g in got if g.finish_reason == "error"]
    assert len(errors) == 1 and "KV capacity exhausted" in (errors[0].error or ""), got
    for g, w in zip(got, want, strict=True):
        if g.finish_reason != "error":
            assert g.token_ids == w.token_ids
    await _idle(client)


async def test_prefill_waits_for_its_exports_instead_of_failing(
    client: BusClient, reference: Engine
) -> None:
    # 180-token prompts hold 45 of p0's 56 usable blocks until their KV is on d0, and d0
    # (64 blocks, 47 per request) admits one at a time: the next prefill must wait.
    prompts = _prompts(3, 180, 2, reference.model_config.vocab_size)
    want = generate(reference, prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    rids = await asyncio.gather(*(client.submit("p0", "d0", p, 4) for p in prompts))
    got = [await client.result(r, timeout_s=60) for r in rids]
    assert [g.error for g in got] == [None] * 3
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    await _idle(client)
