"""The router's door check happens on the prefill worker its pairing picked
(services/router/dispatch.py ``submit``'s ``admit``, services/router/admission.py): with
``round_robin`` pairing a request whose turn lands on a worker with a long queue is shed
(503 + Retry-After, nothing sent, its decode turn given back) although another worker is
idle, and the idle worker's turn admits the same request; one decision per HTTP request
(``n`` > 1: the first sub-request's pair); a retry on another pair after a failed send is
not shed.

A real router and nats-server; the workers are fake bus responders (one token per request)
whose telemetry, published on the bus like a worker's, says p1 is idle and p2 has 30 s of
prefill work queued."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from services.router.app import Router
from services.router.config import RouterConfig
from shared.bus import Bus, BusConfig
from shared.bus.registration import WorkerRegistration
from shared.bus.registry import RegistryConfig
from shared.errors import WorkerNotActiveError
from shared.messages import (
    PrefillRequest,
    Role,
    StreamSequencer,
    Subjects,
    TokenBatch,
    TokenItem,
)
from shared.tokenizer.models import load_tokenizer
from tests.support.fixtures import nats_server_module  # noqa: F401
from tests.support.nats_server import NatsServer
from tests.support.worker_messages import worker_record, worker_telemetry

MODEL = "tiny"
LONG_QUEUE_S = 30.0  # p2's queued prefill work: far beyond the 1 s TTFT SLO
WORKERS: tuple[tuple[str, Role], ...] = (
    ("p1", "prefill"),
    ("p2", "prefill"),
    ("d1", "decode"),
    ("d2", "decode"),
)


@dataclass
class FakeWorkers:
    """Prefill workers that answer each request with one token (finish ``length``) and
    record what they were sent; a worker in ``failing`` refuses sends (worker_not_active)."""

    bus: Bus
    subjects: Subjects
    received: dict[str, list[PrefillRequest]] = field(
        default_factory=lambda: {w: [] for w, _ in WORKERS}
    )
    failing: set[str] = field(default_factory=set)
    seqs: dict[str, StreamSequencer] = field(default_factory=dict)

    def handler(self, worker_id: str) -> Any:
        async def on_prefill(msg: PrefillRequest) -> None:
            if worker_id in self.failing:
                raise WorkerNotActiveError(f"{worker_id} is draining")
            self.received[worker_id].append(msg)
            seq = self.seqs.setdefault(worker_id, StreamSequencer(worker_id))
            item = TokenItem(
                request_id=msg.request_id, index=0, token_ids=(42,), finish_reason="length"
            )
            batch = TokenBatch(
                publisher_id=worker_id,
                epoch=seq.epoch,
                seq=seq.next_seq(msg.tokens_subject),
                items=(item,),
            )
            await self.bus.publish(self.subjects.tokens_from(msg.tokens_subject, worker_id), batch)

        return on_prefill

    async def publish_telemetry(self, seq: int) -> None:
        """p1 idle, p2 with ``LONG_QUEUE_S`` of prefill work queued."""
        for wid, queue_work_s in (("p1", 0.0), ("p2", LONG_QUEUE_S)):
            metrics = {
                "queue_work_s": queue_work_s,
                "prefill_c1_s_per_token": 1e-3,
                "prefill_c0_s": 0.01,
            }
            msg = worker_telemetry(wid, "prefill", seq=seq, metrics=metrics)
            await self.bus.publish(self.subjects.telemetry("prefill", wid), msg)


@pytest.fixture
async def door(
    nats_server_module: NatsServer,  # noqa: F811
) -> AsyncIterator[tuple[Router, FakeWorkers]]:
    prefix = f"t{time.time_ns()}"
    subjects = Subjects(prefix)
    bus = Bus(BusConfig.from_url(nats_server_module.url), subjects)
    await bus.start()
    fake = FakeWorkers(bus, subjects)
    for wid, _ in WORKERS:
        await bus.serve(subjects.worker_prefill(wid), PrefillRequest, fake.handler(wid))
    regs = [
        WorkerRegistration(bus, worker_record(wid, role, model=MODEL), RegistryConfig())
        for wid, role in WORKERS
    ]
    for reg in regs:
        await reg.start()
    cfg = RouterConfig(
        port=0,
        bus=BusConfig.from_url(nats_server_module.url),
        subject_prefix=prefix,
        model=MODEL,
        pairing="round_robin",  # the `static` baseline: p1, p2, p1, ... whatever their load
        ttft_slo_ms=1000.0,
        shed_ttft_multiple=1.0,
        telemetry_stale_s=60.0,  # one telemetry message stays fresh for the whole test
        request_timeout_s=20,
    )
    async with Router(cfg, tokenizer=load_tokenizer(MODEL)) as router:
        assert router.watcher is not None and router.gate is not None
        await router.watcher.wait_until(
            lambda w: len(w.workers(state="active")) == len(WORKERS), 10
        )
        deadline = time.monotonic() + 10.0
        gate, seq = router.gate, 0
        while gate.predict_s(1, "p1") is None or gate.predict_s(1, "p2") is None:
            assert time.monotonic() < deadline, "the router never saw the telemetry"
            await fake.publish_telemetry(seq)  # periodically, as a worker does
            seq += 1
            await asyncio.sleep(0.05)  # polling: the gate has no event for telemetry seen
        yield router, fake
    for reg in regs:
        await reg.stop()
    await bus.stop()


async def post(router: Router, body: dict[str, Any]) -> tuple[int, dict[str, Any], str | None]:
    """POST a completion; (status, JSON body or {} for a stream's 200, Retry-After)."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, **body}
    async with (
        aiohttp.ClientSession() as s,
        s.post(router.url + "/v1/completions", json=body) as r,
    ):
        if r.status == 200 and body.get("stream"):
            text = await r.text()
            assert text.rstrip().endswith("data: [DONE]"), text
            return r.status, {}, None
        return r.status, await r.json(), r.headers.get("Retry-After")


async def test_round_robin_sheds_on_the_long_queue_whose_turn_it_is_and_admits_on_the_idle(
    door: tuple[Router, FakeWorkers],
) -> None:
    router, fake = door
    assert router.gate is not None
    for stream in (False, True):
        status, _, _ = await post(router, {"stream": stream})  # p1's turn: idle, admitted
        assert status == 200
        # p2's turn: 30 s queued. The old best-worker rule predicted on the idle p1 and
        # admitted it, to wait 30 s behind p2's queue.
        status, payload, retry_after = await post(router, {"stream": stream})
        assert status == 503, payload
        assert payload["error"]["code"] == "overloaded"
        assert retry_after is not None and int(retry_after) >= LONG_QUEUE_S - 1
    assert fake.received["p2"] == []  # shed: nothing sent
    # The shed requests' decode turns were given back: the admitted ones alternate.
    assert [m.decode_worker_id for m in fake.received["p1"]] == ["d1", "d2"]
    assert router.gate.shed_total == 2
    assert router.dispatcher is not None and router.dispatcher.in_flight == {}


async def test_one_door_decision_per_request_on_its_first_sub_request(
    door: tuple[Router, FakeWorkers],
) -> None:
    router, fake = door
    # n=2: the first sub-request is paired with p1 and admitted; the second lands on p2
    # and is not checked again (one decision per HTTP request).
    status, payload, _ = await post(router, {"n": 2})
    assert status == 200 and len(payload["choices"]) == 2, payload
    assert (len(fake.received["p1"]), len(fake.received["p2"])) == (1, 1)
    assert (await post(router, {}))[0] == 200  # p1
    # Now the first sub-request's turn is p2's: shed, and neither sub-request was sent.
    status, payload, _ = await post(router, {"n": 2})
    assert status == 503 and payload["error"]["code"] == "overloaded"
    assert (len(fake.received["p1"]), len(fake.received["p2"])) == (2, 1)
    assert router.dispatcher is not None and router.dispatcher.in_flight == {}


async def test_a_retry_after_a_failed_send_is_not_shed(
    door: tuple[Router, FakeWorkers],
) -> None:
    router, fake = door
    fake.failing.add("p1")  # idle, admits the request, then refuses it (draining)
    status, payload, _ = await post(router, {})
    # Retried on p2 (p1 excluded): the request was already admitted, so the long queue
    # there does not shed it.
    assert status == 200, payload
    assert fake.received["p1"] == [] and len(fake.received["p2"]) == 1
    assert router.gate is not None and router.gate.shed_total == 0
    assert router.metrics.submit_retries_total._value.get() == 1
