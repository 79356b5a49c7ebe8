"""Router tests that need no real workers: parsing/validation, stream reassembly, pairing,
text assembly, the no-torch import rule, and the HTTP API against a real nats-server with
a scripted fake worker (a bus responder that publishes TokenBatches like a worker does)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field

import aiohttp
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.router.app import Router
from services.router.choice import TextAssembler
from services.router.config import RouterConfig
from services.router.errors import BadRequest, ModelNotFound
from services.router.openai_api import (
    GenerationRequest,
    parse_chat,
    parse_completion,
    resolve_max_tokens,
)
from services.router.pairing import NoWorkerError, RoundRobinPolicy
from services.router.pressure_pairing import PressurePolicy
from services.router.streams import RequestStream
from shared.bus import Bus, BusConfig
from shared.bus.registration import WorkerRegistration
from shared.bus.registry import RegistryConfig
from shared.messages import (
    CancelRequest,
    PrefillRequest,
    Role,
    StreamSequencer,
    Subjects,
    TokenBatch,
    TokenItem,
    WorkerRecord,
    WorkerTelemetry,
)
from shared.tokenizer.models import load_tokenizer
from tests.support.fixtures import nats_server_module  # noqa: F401
from tests.support.nats_server import NatsServer
from tests.support.worker_messages import worker_record, worker_telemetry

MODEL = "tiny"
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return load_tokenizer(MODEL)


# ---------------------------------------------------------------- stream reassembly
def item(index: int, *tokens: int, finish: str | None = None, **kw: object) -> TokenItem:
    return TokenItem(
        request_id="r",
        index=index,
        token_ids=tokens,
        finish_reason=finish,
        **kw,  # type: ignore[arg-type]
    )


async def drain(stream: RequestStream) -> tuple[list[int], str]:
    out: list[int] = []
    while True:
        chunk = await asyncio.wait_for(stream.next(), 1.0)
        out += chunk.token_ids
        if chunk.end is not None:
            return out, chunk.end.finish_reason


async def test_stream_reorders_and_waits_for_gap() -> None:
    s = RequestStream("r")
    s.offer(item(2, 12))
    s.offer(item(3, 13, finish="length"))
    s.offer(item(1, 11))
    assert not s.finished and s.num_tokens == 0  # index 0 (prefill worker) still missing
    s.offer(item(0, 10))
    assert s.finished
    assert await drain(s) == ([10, 11, 12, 13], "length")


async def test_stream_drops_duplicates_and_items_after_finish() -> None:
    s = RequestStream("r")
    s.offer(item(0, 10))
    s.offer(item(0, 99))  # duplicate position: first wins
    s.offer(item(1, 11, finish="stop"))
    s.offer(item(2, 12))  # after the end
    s.offer(item(1, 11, finish="error", error="late"))  # later finish is ignored
    assert await drain(s) == ([10, 11], "stop")


async def test_stream_error_ends_at_once() -> None:
    s = RequestStream("r")
    s.offer(item(0, 10))
    s.offer(item(2, 12))
    s.offer(item(0, finish="error", error="kv gone", error_code="kv_capacity_exhausted"))
    chunk = await s.next()
    assert chunk.token_ids == [10] and chunk.end is not None
    assert chunk.end.failed and chunk.end.error_code == "kv_capacity_exhausted"
    with pytest.raises(RuntimeError):
        await s.next()


async def test_stream_fail_from_router_side_and_incremental_chunks() -> None:
    s = RequestStream("r")
    s.offer(item(0, 10))
    first = await s.next()
    assert first.token_ids == [10] and first.end is None
    waiter = asyncio.ensure_future(s.next())
    await asyncio.sleep(0)
    assert not waiter.done()
    s.fail("worker gone", "worker_lost")
    chunk = await asyncio.wait_for(waiter, 1.0)
    assert chunk.token_ids == [] and chunk.end is not None and chunk.end.error_code == "worker_lost"


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_stream_property_any_order_any_duplicates(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 12))
    tokens = data.draw(st.lists(st.integers(0, 300), min_size=n, max_size=n))
    # split into items [start, end) at random cut points (like per-iteration batches)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, n - 1), max_size=n)) if n > 1 else []))
    bounds = [0, *cuts, n]
    items = [
        item(a, *tokens[a:b], finish="length" if b == n else None)
        for a, b in itertools.pairwise(bounds)
    ]
    items += data.draw(st.lists(st.sampled_from(items), max_size=4))  # duplicates
    order = data.draw(st.permutations(items))

    async def run() -> tuple[list[int], str]:
        s = RequestStream("r")
        for it in order:
            s.offer(it)
        return await drain(s)

    assert asyncio.run(run()) == (tokens, "length")


# ---------------------------------------------------------------- pairing
def record(worker_id: str, role: Role, state: str = "active") -> WorkerRecord:
    return worker_record(
        worker_id,
        role,
        state=state,
        model=MODEL,
        kv_total_blocks=100,
        max_model_len=MAX_MODEL_LEN,
    )


def telemetry(
    worker_id: str,
    role: Role,
    *,
    ppi: float = 0.0,
    queue_len: int = 0,
    free_blocks: int = 100,
    dpi_adm: float = 0.0,
) -> WorkerTelemetry:
    return worker_telemetry(
        worker_id,
        role,
        queue_len=queue_len,
        free_blocks=free_blocks,
        total_blocks=100,
        ppi=ppi,
        dpi_adm=dpi_adm,
    )


P = [record("p1", "prefill"), record("p2", "prefill")]
D = [record("d1", "decode"), record("d2", "decode"), record("d3", "decode")]


def test_round_robin_cycles_roles_independently() -> None:
    rr = RoundRobinPolicy()
    pairs = [rr.choose(P, D) for _ in range(6)]
    assert [p for p, _ in pairs] == ["p1", "p2"] * 3
    assert [d for _, d in pairs] == ["d1", "d2", "d3"] * 2
    assert rr.choose(P, D, frozenset({"p1", "p2"}))[0] in ("p1", "p2")  # all excluded: reuse
    with pytest.raises(NoWorkerError):
        rr.choose([], D)


def test_pressure_picks_lowest_ppi_and_least_pressured_decode() -> None:
    pol = PressurePolicy(stale_after_s=5.0)
    t = time.monotonic()
    pol.observe(telemetry("p1", "prefill", ppi=0.9), now_mono_s=t)
    pol.observe(telemetry("p2", "prefill", ppi=0.2), now_mono_s=t)
    pol.observe(telemetry("d1", "decode", dpi_adm=0.5, free_blocks=50), now_mono_s=t)
    pol.observe(telemetry("d2", "decode", dpi_adm=0.1, free_blocks=10), now_mono_s=t)
    pol.observe(telemetry("d3", "decode", dpi_adm=0.1, free_blocks=80), now_mono_s=t)
    assert pol.choose(P, D, now_mono_s=t) == ("p2", "d3")
    # ties on the estimated ppi break on queue length (plus requests sent since telemetry);
    # a request of 1 token adds next to nothing to a worker's estimated PPI (but not 0).
    t += 0.1
    pol.observe(telemetry("p1", "prefill", ppi=0.0, queue_len=3), now_mono_s=t)
    pol.observe(telemetry("p2", "prefill", ppi=0.0, queue_len=1), now_mono_s=t)
    assert pol.choose(P, D, now_mono_s=t, prompt_tokens=1)[0] == "p2"
    assert pol.choose(P, D, now_mono_s=t, prompt_tokens=1)[0] == "p1"  # p2 now above 0
    # excluded workers are skipped
    assert pol.choose(P, D, frozenset({"p2", "d3"}), now_mono_s=t)[1] in ("d1", "d2")


def test_pressure_falls_back_to_round_robin_without_fresh_telemetry() -> None:
    pol = PressurePolicy(stale_after_s=0.5)
    assert [pol.choose(P, D)[0] for _ in range(4)] == ["p1", "p2", "p1", "p2"]
    pol.observe(telemetry("p2", "prefill", ppi=0.5), now_mono_s=time.monotonic() - 10)
    assert [pol.choose(P, D)[0] for _ in range(2)] == ["p1", "p2"]  # stale: ignored
    pol.observe(telemetry("p2", "prefill", ppi=0.5))
    assert [pol.choose(P, D)[0] for _ in range(3)] == ["p2"] * 3  # p1 has none: ranks last


# ---------------------------------------------------------------- request parsing
BAD_COMPLETIONS = [
    ([], None),
    ({"prompt": "hi"}, "model"),
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": "a\ud800"}, "prompt"),  # a JSON "\ud800" escape: not Unicode
    ({"model": MODEL, "prompt": []}, "prompt"),
    ({"model": MODEL, "prompt": 5}, "prompt"),
    ({"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
    ({"model": MODEL, "prompt": [1, 10**9]}, "prompt"),
    ({"model": MODEL, "prompt": [1, -1]}, "prompt"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": True}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": "hi", "n": 0}, "n"),
    ({"model": MODEL, "prompt": "hi", "n": 2, "best_of": 1}, "best_of"),
    ({"model": MODEL, "prompt": "hi", "best_of": 2, "stream": True}, "best_of"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "logprobs": True}, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "top_logprobs": 2}, "top_logprobs"),
    ({"model": MODEL, "prompt": "hi", "echo": 1}, "echo"),
    ({"model": MODEL, "prompt": "hi", "stop": 3}, "stop"),
    ({"model": MODEL, "prompt": "hi", "stream": "yes"}, "stream"),
    ({"model": MODEL, "prompt": "hi", "seed": 1.5}, "seed"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS)
def test_parse_completion_rejects(tokenizer, body: object, param: str | None) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(BadRequest) as info:
        parse_completion(body, tokenizer, MODEL)
    assert info.value.http_status == 400 and info.value.param == param


def test_parse_completion_forms_and_defaults(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tuple(tokenizer.encode("Hello world"))
    for prompt in ("Hello world", list(ids), ["Hello world"], [list(ids)]):
        req = parse_completion({"model": MODEL, "prompt": prompt}, tokenizer, MODEL)
        assert req.prompt_token_ids == ids and req.max_tokens == 16
    req = parse_completion(
        {
            "model": MODEL,
            "prompt": "x",
            "stop": "a",
            "seed": 7,
            "top_k": -1,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        tokenizer,
        MODEL,
    )
    assert (req.stop, req.seed, req.top_k, req.stream, req.include_usage) == (
        ("a",),
        7,
        0,
        True,
        True,
    )
    with pytest.raises(ModelNotFound):
        parse_completion({"model": "other", "prompt": "x"}, tokenizer, MODEL)


def test_parse_chat_and_context_limit(tokenizer) -> None:  # type: ignore[no-untyped-def]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    req = parse_chat(body, tokenizer, MODEL)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert req.prompt_token_ids == tuple(tokenizer.encode(text)) and req.max_tokens is None
    assert resolve_max_tokens(req, 100) == 100 - len(req.prompt_token_ids)
    parts = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    }
    assert parse_chat(parts, tokenizer, MODEL).prompt_token_ids == req.prompt_token_ids
    for bad in (
        {"model": MODEL, "messages": []},
        {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
        {"model": MODEL, "messages": [{"role": "user", "content": 3}]},
        {**body, "max_completion_tokens": 0},
    ):
        with pytest.raises(BadRequest):
            parse_chat(bad, tokenizer, MODEL)
    too_long = GenerationRequest("completion", (1,) * 10, max_tokens=60)
    with pytest.raises(BadRequest) as info:
        resolve_max_tokens(too_long, MAX_MODEL_LEN)
    assert info.value.code == "context_length_exceeded"


def test_text_assembler_multibyte_and_stop(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "héllo → wörld ✓ end"
    ids = tokenizer.encode(text)
    asm = TextAssembler(tokenizer, GenerationRequest("completion", (1,), 16))
    pieces = [asm.push([t], [0.0]) for t in ids]
    assert "".join(pieces) + asm.finish() == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    asm = TextAssembler(tokenizer, GenerationRequest("completion", (1,), 16, stop=("wör",)))
    out = "".join(asm.push([t], [0.0]) for t in ids) + asm.finish()
    assert asm.stopped and out == tokenizer.decode(ids).split("wör")[0]
    assert asm.num_tokens < len(ids)


def test_router_import_does_not_load_torch() -> None:
    code = (
        "import sys, services.router.app, services.router.__main__; "
        "from shared.tokenizer.models import load_tokenizer; load_tokenizer('tiny'); "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------- HTTP with a fake worker
@dataclass
class FakeWorkers:
    """A prefill "p1" and a decode "d1" in one bus client. ``mode`` scripts the reply:
    ``echo`` streams ``script`` (index 0 from p1, the rest from d1 first, out of order, with
    a duplicate), ``kv_error`` ends with kv_capacity_exhausted, ``hang`` sends nothing."""

    bus: Bus
    subjects: Subjects
    script: list[int]
    mode: str = "echo"
    received: list[PrefillRequest] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    got_request: asyncio.Event = field(default_factory=asyncio.Event)
    seqs: dict[str, StreamSequencer] = field(default_factory=dict)

    async def publish(self, publisher: str, subject: str, items: list[TokenItem]) -> None:
        seq = self.seqs.setdefault(publisher, StreamSequencer(publisher))
        batch = TokenBatch(
            publisher_id=publisher, epoch=seq.epoch, seq=seq.next_seq(subject), items=tuple(items)
        )
        await self.bus.publish(self.subjects.tokens_from(subject, publisher), batch)

    async def on_prefill(self, msg: PrefillRequest) -> None:
        self.received.append(msg)
        self.got_request.set()
        rid, subj, n = (
            msg.request_id,
            msg.tokens_subject,
            min(len(self.script), msg.sampling.max_tokens),
        )
        if self.mode == "kv_error":
            await self.publish(
                "p1",
                subj,
                [
                    TokenItem(
                        request_id=rid,
                        finish_reason="error",
                        error="no KV blocks",
                        error_code="kv_capacity_exhausted",
                    )
                ],
            )
        elif self.mode == "echo":
            decode_items = [
                TokenItem(
                    request_id=rid,
                    index=i,
                    token_ids=(self.script[i],),
                    finish_reason="length" if i == n - 1 else None,
                )
                for i in range(1, n)
            ]
            await self.publish("d1", subj, decode_items[::-1])
            first = TokenItem(
                request_id=rid,
                index=0,
                token_ids=(self.script[0],),
                finish_reason="length" if n == 1 else None,
            )
            await self.publish("p1", subj, [first, first])
        elif self.mode == "handover":
            # p1 streams the first token, then hands the decode part to d9 (a re-pairing);
            # x9, never given the request, tries to slip a token in before d9 streams.
            await self.publish("p1", subj, [TokenItem(request_id=rid, token_ids=(self.script[0],))])
            forged = TokenItem(request_id=rid, index=1, token_ids=(self.script[0],))
            await self.publish("x9", subj, [forged])
            await self.publish(
                "p1", subj, [TokenItem(request_id=rid, handed_to="d9", handed_role="decode")]
            )
            await self.publish("x9", subj, [forged])
            rest = [
                TokenItem(
                    request_id=rid,
                    index=i,
                    token_ids=(self.script[i],),
                    finish_reason="length" if i == n - 1 else None,
                )
                for i in range(1, n)
            ]
            await self.publish("d9", subj, rest)

    async def on_cancel(self, msg: CancelRequest) -> None:
        self.cancels.append(msg.request_id)


@pytest.fixture
async def cluster(nats_server_module: NatsServer, tokenizer):  # type: ignore[no-untyped-def]  # noqa: F811
    prefix = f"t{time.time_ns()}"
    subjects = Subjects(prefix)
    bus = Bus(BusConfig.from_url(nats_server_module.url), subjects)
    await bus.start()
    script = tokenizer.encode(" The quick brown fox jumps ✓ over the lazy dog")
    fake = FakeWorkers(bus, subjects, script)
    for wid in ("p1", "d1"):
        await bus.serve(subjects.worker_prefill(wid), PrefillRequest, fake.on_prefill)
        await bus.serve(subjects.worker_cancel(wid), CancelRequest, fake.on_cancel)
    roles: tuple[tuple[str, Role], ...] = (("p1", "prefill"), ("d1", "decode"))
    regs = {
        wid: WorkerRegistration(bus, record(wid, role), RegistryConfig(heartbeat_s=0.5))
        for wid, role in roles
    }
    for reg in regs.values():
        await reg.start()
    cfg = RouterConfig(
        port=0,
        bus=BusConfig.from_url(nats_server_module.url),
        subject_prefix=prefix,
        model=MODEL,
        pairing="round_robin",
        request_timeout_s=20,
    )
    async with Router(cfg, tokenizer=tokenizer) as router:
        await router.watcher.wait_until(lambda w: len(w.workers(state="active")) == 2, 10)  # type: ignore[union-attr]
        yield router, fake, regs
    for reg in regs.values():
        await reg.stop()
    await bus.stop()


async def post(router: Router, path: str, body: object) -> tuple[int, dict, dict]:  # type: ignore[type-arg]
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as s, s.post(router.url + path, data=data) as r:
        return r.status, await r.json(), dict(r.headers)


async def test_http_validation_errors_are_openai_shaped(cluster) -> None:  # type: ignore[no-untyped-def]
    router, fake, _ = cluster
    cases = [
        (b"{not json", 400, None),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "invalid_request_error"),
        ({"model": MODEL, "prompt": [1] * 10, "max_tokens": 60}, 400, "context_length_exceeded"),
        ({"model": MODEL, "prompt": [10**6]}, 400, "invalid_request_error"),
        ({"model": "nope", "prompt": "hi"}, 404, "model_not_found"),
    ]
    for body, status, code in cases:
        got, payload, _ = await post(router, "/v1/completions", body)
        assert got == status, payload
        err = payload["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        if code:
            assert err["code"] == code
    got, payload, _ = await post(router, "/v1/chat/completions", {"model": MODEL})
    assert got == 400 and payload["error"]["param"] == "messages"
    got, payload, _ = await post(router, "/v1/nothing", {})
    assert got == 404 and "error" in payload
    assert fake.received == []  # nothing invalid reached a worker


async def test_openai_client_completions_and_chat(cluster, tokenizer) -> None:  # type: ignore[no-untyped-def]
    router, fake, _ = cluster
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    want = tokenizer.decode(fake.script[:8])
    out = await client.completions.create(model=MODEL, prompt="Hi there", max_tokens=8)
    assert out.choices[0].text == want and out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 8
    msg = fake.received[-1]
    assert msg.prompt_token_ids == tuple(tokenizer.encode("Hi there"))
    assert msg.sampling.seed is not None and msg.decode_worker_id == "d1"
    stream = await client.completions.create(
        model=MODEL,
        prompt="Hi",
        max_tokens=8,
        stream=True,
        seed=5,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    assert fake.received[-1].sampling.seed == 5
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
    )
    deltas = [c.choices[0].delta async for c in chat]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == want
    whole = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stop=["fox"]
    )
    full = tokenizer.decode(fake.script)
    assert "fox" in full and whole.choices[0].message.content == full.split("fox")[0]
    assert whole.choices[0].finish_reason == "stop"
    await asyncio.sleep(0.2)  # the stop-string cancel is a publish: give it a moment
    assert fake.received[-1].request_id in fake.cancels
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_worker_error_maps_to_503_with_retry_after(cluster) -> None:  # type: ignore[no-untyped-def]
    router, fake, _ = cluster
    fake.mode = "kv_error"
    status, payload, headers = await post(
        router, "/v1/completions", {"model": MODEL, "prompt": "hi"}
    )
    assert status == 503 and payload["error"]["code"] == "kv_capacity_exhausted"
    assert headers.get("Retry-After") == "1"


async def test_a_bound_worker_hands_the_stream_on_and_no_one_else_can(  # type: ignore[no-untyped-def]
    cluster, tokenizer
) -> None:
    router, fake, _ = cluster
    fake.mode = "handover"
    body = {"model": MODEL, "prompt": "hi", "max_tokens": len(fake.script), "temperature": 0}
    status, payload, _ = await post(router, "/v1/completions", body)
    assert status == 200, payload
    assert payload["choices"][0]["text"] == tokenizer.decode(fake.script)
    foreign = router.metrics.foreign_token_items_total._value.get()
    assert foreign >= 2  # x9's items, before and after the hand-over


async def test_worker_leaving_ends_its_requests(cluster) -> None:  # type: ignore[no-untyped-def]
    router, fake, regs = cluster
    fake.mode = "hang"
    task = asyncio.ensure_future(post(router, "/v1/completions", {"model": MODEL, "prompt": "hi"}))
    await asyncio.wait_for(fake.got_request.wait(), 5)
    await regs["d1"].stop()  # deregisters: the watcher sees it removed
    status, payload, _ = await asyncio.wait_for(task, 10)
    assert status == 503 and payload["error"]["code"] == "worker_lost"
    async with aiohttp.ClientSession() as s, s.get(router.url + "/health") as r:
        assert r.status == 503 and "decode" in (await r.json())["reason"]


async def test_health_metrics_and_disconnect_cancels(cluster) -> None:  # type: ignore[no-untyped-def]
    router, fake, _ = cluster
    async with aiohttp.ClientSession() as s:
        async with s.get(router.url + "/health") as r:
            assert r.status == 200 and await r.json() == {"status": "ok"}
        fake.mode = "hang"
        body = {"model": MODEL, "prompt": "hi", "stream": True}
        # A stream's headers wait for its first token, which never comes: the client goes
        # away while they are held and the request is on the worker (closing its connection).
        fake.got_request.clear()  # set by earlier tests: wait for this request's arrival
        post = asyncio.ensure_future(s.post(router.url + "/v1/completions", json=body))
        await asyncio.wait_for(fake.got_request.wait(), 10)
        assert not post.done()  # no headers yet
        post.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await post
    rid = fake.received[-1].request_id
    deadline = time.monotonic() + 10.0
    while rid not in fake.cancels and time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # polling: the fake worker has no event for cancels
    assert rid in fake.cancels
    async with aiohttp.ClientSession() as s, s.get(router.url + "/metrics") as r:
        text = await r.text()
    assert "fluidpd_router_requests_total" in text and "fluidpd_bus_requests_total" in text


def test_router_process_prints_ready_and_stops_on_sigterm(
    nats_server_module: NatsServer,  # noqa: F811
) -> None:
    import signal
    import urllib.error
    import urllib.request

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.router",
            "--nats",
            nats_server_module.url,
            "--model",
            MODEL,
            "--port",
            "0",
            "--subject-prefix",
            f"proc{time.time_ns()}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = ""
        for line in proc.stdout:  # blocks until the ready line (or the process exits)
            if line.startswith("router_ready url="):
                break
        assert line.startswith("router_ready url=http://127.0.0.1:"), line
        url = line.split("=", 1)[1].strip()
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(url + "/health", timeout=5)
        assert info.value.code == 503  # no workers registered under this prefix
        with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
            assert json.load(r)["data"][0]["id"] == MODEL
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
