"""Real worker processes (tiny model), real nats-server, real UCX: the disaggregated path,
the FluidToken split path and the single-worker path all reproduce `generate` exactly."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.generate import generate
from shared.sampling_params import SamplingParams
from tests.support.nats_server import NatsServer
from tests.support.workers import BusClient, worker_pair

# Every async test shares the module's loop (and its cluster client); marked one by one,
# because the hypothesis test below is sync (it drives that loop itself).
MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def cluster(
    nats_users_module: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("worker-logs")
    args = ("--model", "tiny", "--num-kv-blocks", "256", "--block-size", "4")
    with worker_pair(nats_users_module, logs, *args) as url:
        yield url


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(cluster: str) -> AsyncIterator[BusClient]:
    async with BusClient(cluster) as c:
        await c.wait_workers(["p0", "d0"])
        yield c


@pytest.fixture(scope="module")
def reference() -> Engine:
    return Engine.load(EngineConfig(model="tiny", block_size=4, num_kv_blocks=512))


def _prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randrange(3, 60))] for _ in range(n)]


async def _all_blocks_free(client: BusClient) -> None:
    await client.wait_telemetry(
        lambda t: all(
            t.get(w)
            and t[w].free_blocks == t[w].total_blocks
            and t[w].queue_len == 0
            and t[w].running == 0
            for w in ("p0", "d0")
        )
    )


@MODULE_LOOP
async def test_disaggregated_equals_generate(client: BusClient, reference: Engine) -> None:
    prompts = _prompts(8, 1, reference.model_config.vocab_size)
    want = generate(reference, prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    rids = await asyncio.gather(*(client.submit("p0", "d0", p, 12) for p in prompts))
    got = [await client.result(r) for r in rids]
    for g, w in zip(got, want, strict=True):
        assert g.error is None
        assert g.token_ids == w.token_ids and g.finish_reason == "length"
        assert g.indices == list(range(12))
    await _all_blocks_free(client)


@MODULE_LOOP
@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
async def test_split_equals_unsplit(client: BusClient, reference: Engine, beta: float) -> None:
    prompts = _prompts(3, 2, reference.model_config.vocab_size)
    want = generate(reference, prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    rids = [await client.submit("p0", "d0", p, 8, steal_ratio=beta) for p in prompts]
    for rid, w in zip(rids, want, strict=True):
        got = await client.result(rid)
        assert got.error is None and got.token_ids == w.token_ids
    stolen = client.telemetry["d0"].metrics["decode_stolen_tokens_total"]
    assert stolen > 0
    await _all_blocks_free(client)


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(beta=st.floats(0.0, 0.99), length=st.integers(2, 50))
def test_random_split_equals_unsplit(
    client: BusClient, reference: Engine, beta: float, length: int
) -> None:
    prompt = _prompts(1, length, reference.model_config.vocab_size)[0][:length] or [5, 6]
    want = generate(reference, [prompt], SamplingParams(max_tokens=5, ignore_eos=True))[0]

    async def run() -> list[int]:
        rid = await client.submit("p0", "d0", prompt, 5, steal_ratio=beta)
        return (await client.result(rid)).token_ids

    loop = asyncio.get_event_loop_policy().get_event_loop()
    assert loop.run_until_complete(run()) == want.token_ids


@MODULE_LOOP
async def test_seeded_sampling_matches_generate(client: BusClient, reference: Engine) -> None:
    prompt = _prompts(1, 3, reference.model_config.vocab_size)[0]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=42, ignore_eos=True)
    want = generate(reference, [prompt], params)[0]
    rid = await client.submit("p0", "d0", prompt, 10, seed=42, temperature=1.0)
    assert (await client.result(rid)).token_ids == want.token_ids


@MODULE_LOOP
async def test_single_worker_path(client: BusClient, reference: Engine) -> None:
    prompt = _prompts(1, 4, reference.model_config.vocab_size)[0]
    want = generate(reference, [prompt], SamplingParams(max_tokens=9, ignore_eos=True))[0]
    rid = await client.submit("d0", "d0", prompt, 9)
    assert (await client.result(rid)).token_ids == want.token_ids
    await _all_blocks_free(client)


@MODULE_LOOP
async def test_cancel_mid_decode_frees_blocks(client: BusClient) -> None:
    rid = await client.submit("p0", "d0", list(range(10, 40)), 900)
    await client.wait_telemetry(
        lambda t: (
            len(client.results.get(rid, None).token_ids) > 3 if rid in client.results else False
        )
    )
    await client.cancel(rid, ["p0", "d0"])
    await _all_blocks_free(client)
    assert client.results[rid].finish_reason is None  # never finished: it was cancelled


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@MODULE_LOOP
async def test_idle_workers_do_not_spin(client: BusClient) -> None:
    # After KV transfers (the tests above), an idle worker sleeps in epoll: ucxx's blocking
    # progress mode left unarmed kept the event loop busy (~40% of a core per worker,
    # and +5 ms per engine step waiting for the GIL).
    rid = await client.submit("p0", "d0", list(range(10, 50)), 4)
    assert (await client.result(rid)).error is None
    await _all_blocks_free(client)
    pids = {w: int(client.telemetry[w].metrics["pid"]) for w in ("p0", "d0")}
    before = {w: _cpu_seconds(pid) for w, pid in pids.items()}
    await asyncio.sleep(2.0)  # the measurement window itself, not a synchronisation
    used = {w: _cpu_seconds(pid) - before[w] for w, pid in pids.items()}
    assert all(seconds < 0.3 for seconds in used.values()), used  # < 15% of a core
