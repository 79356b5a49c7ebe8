"""Decode-side waiting on real workers (tiny model, real nats-server and UCX): a decode
worker with one batch slot keeps every accepted request waiting for capacity instead of
failing it; a waiting request whose client leaves is cancelled on both workers with its
blocks freed; a request that waits longer than the decode-wait timeout ends with a clear
``decode_wait_timeout`` error. The waiting shows in both workers' telemetry (DPI_adm)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.generate import generate
from shared.messages import WorkerTelemetry
from shared.sampling_params import SamplingParams
from tests.support.nats_server import NatsServer
from tests.support.workers import BusClient, start_worker, stop_all

pytestmark = pytest.mark.asyncio(loop_scope="module")
BLOCK = 4
ARGS = ("--model", "tiny", "--num-kv-blocks", "256", "--block-size", str(BLOCK), "--no-fluidtoken")
WORKERS = ("p0", "p1", "d0")


@pytest.fixture(scope="module")
def cluster(
    nats_users_module: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """p0 (default decode-wait timeout), p1 (0.5 s) and d0, which decodes one request at a
    time (``--max-num-seqs 1``): every second concurrent request must wait for it."""
    logs = tmp_path_factory.mktemp("decode-wait-logs")
    url = nats_users_module
    procs = [
        start_worker("prefill", "p0", url, *ARGS, log_dir=logs),
        start_worker("prefill", "p1", url, *ARGS, "--decode-wait-timeout-s", "0.5", log_dir=logs),
        start_worker("decode", "d0", url, *ARGS, "--max-num-seqs", "1", log_dir=logs),
    ]
    try:
        yield url
    finally:
        assert stop_all(procs) == [0, 0, 0], "workers must exit cleanly on SIGTERM"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(cluster: str) -> AsyncIterator[BusClient]:
    async with BusClient(cluster) as c:
        await c.wait_workers(list(WORKERS))
        yield c


@pytest.fixture(scope="module")
def reference() -> Engine:
    return Engine.load(EngineConfig(model="tiny", block_size=BLOCK, num_kv_blocks=512))


def _prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(length)] for _ in range(n)]


def _metric(t: dict[str, WorkerTelemetry], wid: str, name: str) -> float:
    w = t.get(wid)
    return -1.0 if w is None else w.metrics.get(name, 0.0)


def _idle(t: dict[str, WorkerTelemetry]) -> bool:
    return all(
        (w := t.get(wid)) is not None
        and w.free_blocks == w.total_blocks
        and w.running == 0
        and w.queue_len == 0
        and w.metrics.get("admission_waiting", 0) == 0
        and w.metrics.get("reserved_blocks", 0) == 0
        for wid in WORKERS
    )


async def _waiting_on(client: BusClient, prefill_id: str, n: int = 1) -> None:
    """Until ``prefill_id`` holds ``n`` requests waiting for decode capacity and d0 counts
    them in DPI_adm (1: no slot left)."""
    await client.wait_telemetry(
        lambda t: (
            _metric(t, prefill_id, "admission_waiting") >= n
            and _metric(t, "d0", "decode_waiting") >= 1
            and t["d0"].dpi_adm == 1.0
        ),
        30.0,
    )


async def test_decode_full_keeps_every_accepted_request_until_it_completes(
    client: BusClient, reference: Engine
) -> None:
    prompts = _prompts(3, 12, 1, reference.model_config.vocab_size)
    want = generate(reference, prompts, SamplingParams(max_tokens=50, ignore_eos=True))
    rids = [await client.submit("p0", "d0", p, 50) for p in prompts]
    await _waiting_on(client, "p0")  # some of them did wait for d0's one slot
    got = [await client.result(r, timeout_s=120) for r in rids]
    assert [g.finish_reason for g in got] == ["length"] * 3, [g.error for g in got]
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
    await client.wait_telemetry(_idle, 30.0)


async def test_a_waiting_request_whose_client_leaves_is_cancelled_on_both_workers(
    client: BusClient, reference: Engine
) -> None:
    long_p, waiting_p = _prompts(2, 12, 2, reference.model_config.vocab_size)
    holder = await client.submit("p0", "d0", long_p, 400)
    await client.wait_until(lambda: len(client.results[holder].token_ids) >= 2, 30.0)
    waiting = await client.submit("p0", "d0", waiting_p, 20)
    await _waiting_on(client, "p0")
    await client.cancel(waiting, ["p0", "d0"])  # what the router does when a client leaves
    await client.wait_telemetry(
        lambda t: (
            _metric(t, "p0", "admission_waiting") == 0 and _metric(t, "d0", "decode_waiting") == 0
        ),
        10.0,
    )
    await client.cancel(holder, ["p0", "d0"])
    await client.wait_telemetry(_idle, 30.0)  # every block back, on both workers
    rec = client.results[waiting]
    assert rec.finish_reason is None  # cancelled: no error item, no completion
    assert set(rec.publishers) <= {"p0"} and len(rec.token_ids) <= 1  # d0 never ran it


async def test_decode_wait_timeout_ends_a_request_with_a_clear_error(
    client: BusClient, reference: Engine
) -> None:
    long_p, waiting_p = _prompts(2, 12, 3, reference.model_config.vocab_size)
    holder = await client.submit("p0", "d0", long_p, 400)
    await client.wait_until(lambda: len(client.results[holder].token_ids) >= 2, 30.0)
    late = await client.submit("p1", "d0", waiting_p, 20)  # p1 waits at most 0.5 s
    rec = await client.result(late, timeout_s=30)
    assert rec.finish_reason == "error"
    assert "decode-wait timeout" in (rec.error or ""), rec.error
    await client.wait_telemetry(lambda t: _metric(t, "p1", "decode_wait_timeouts_total") == 1, 10.0)
    await client.cancel(holder, ["p0", "d0"])
    await client.wait_telemetry(_idle, 30.0)
    # The holder held d0's one slot through p1's timeout; on a slow host it may finish
    # its 400 tokens before the cancel lands. Either way it never fails.
    done = client.results[holder]
    assert done.finish_reason in (None, "length") and done.error is None, done.error


async def test_a_waiting_request_is_re_paired_to_a_decode_worker_with_room(
    cluster: str, client: BusClient, reference: Engine, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Last in the module: it adds d1, after which nothing would have to wait."""
    long_p, moved_p = _prompts(2, 12, 4, reference.model_config.vocab_size)
    want = generate(reference, [moved_p], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    logs = tmp_path_factory.mktemp("decode-wait-d1")
    d1 = start_worker("decode", "d1", cluster, *ARGS, "--max-num-seqs", "1", log_dir=logs)
    try:
        await client.wait_workers(["d1"])
        await client.wait_telemetry(lambda t: "d1" in t and _idle(t), 30.0)
        before = _metric(client.telemetry, "p0", "repaired_for_capacity_total")
        holder = await client.submit("p0", "d0", long_p, 400)
        await client.wait_until(lambda: len(client.results[holder].token_ids) >= 2, 30.0)
        moved = await client.submit("p0", "d0", moved_p, 20)  # d0 is full: d1 takes it
        rec = await client.result(moved, timeout_s=60)
        assert rec.finish_reason == "length" and rec.token_ids == want.token_ids, rec.error
        assert set(rec.publishers) == {"p0", "d1"}
        await client.wait_telemetry(
            lambda t: _metric(t, "p0", "repaired_for_capacity_total") == before + 1, 10.0
        )
        await client.cancel(holder, ["p0", "d0"])
        await client.wait_telemetry(
            lambda t: _idle(t) and t["d1"].free_blocks == t["d1"].total_blocks, 30.0
        )
    finally:
        assert stop_all([d1]) == [0]


async def test_a_prefill_to_decode_switch_does_not_wait_for_requests_waiting_for_decode(
    client: BusClient, reference: Engine
) -> None:
    """A P->D switch adds decode capacity; it must not wait for the requests that wait for
    decode capacity (they keep their KV and go on waiting after the flip)."""
    long_p, waiting_p = _prompts(2, 12, 5, reference.model_config.vocab_size)
    want = generate(reference, [waiting_p], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    holder = await client.submit("p0", "d0", long_p, 400)
    await client.wait_until(lambda: len(client.results[holder].token_ids) >= 2, 30.0)
    waiting = await client.submit("p0", "d0", waiting_p, 20)
    await _waiting_on(client, "p0")
    assert (await client.switch("p0", "decode")).ok
    await client.wait_telemetry(
        lambda t: (
            t["p0"].role == "decode"
            and t["p0"].state == "active"
            and _metric(t, "p0", "admission_waiting") == 1
        ),  # flipped while it still waits
        30.0,
    )
    await client.cancel(holder, ["p0", "d0"])  # d0's slot frees: the waiting request runs
    rec = await client.result(waiting, timeout_s=60)
    assert rec.finish_reason == "length" and rec.token_ids == want.token_ids, rec.error
    await client.wait_telemetry(_idle, 30.0)
    assert (await client.switch("p0", "prefill")).ok
    await client.wait_telemetry(lambda t: t["p0"].role == "prefill" and _idle(t), 30.0)
