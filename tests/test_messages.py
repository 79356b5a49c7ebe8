"""Messages, codec, size bounds, token batching, sequence tracking, subjects (no server)."""

from __future__ import annotations

import json

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.errors import ContextLengthError, InvalidRequestError
from shared.messages import (
    ALL_MESSAGE_TYPES,
    MAX_MESSAGE_BYTES,
    MAX_WIRE_BLOCKS,
    MAX_WIRE_TOKEN_IDS,
    Ack,
    AdmitReply,
    AdmitRequest,
    CancelRequest,
    ControllerDecision,
    ErrorReply,
    MessageError,
    MessageTooLargeError,
    MigrateRequest,
    Observation,
    PolicyCommand,
    PolicyReply,
    PrefillRequest,
    SamplingParams,
    SequenceTracker,
    StateEvent,
    StatusReply,
    StatusRequest,
    StreamSequencer,
    Subjects,
    SwitchCommand,
    SwitchLeaseReply,
    SwitchLeaseRequest,
    SwitchReply,
    TokenBatch,
    TokenItem,
    TokenLogprob,
    WorkerRecord,
    WorkerRow,
    WorkerTelemetry,
    check_context_fits,
    decode,
    decode_reply,
    encode,
    is_json,
    pack_token_batches,
)
from shared.messages.common import MAX_ERROR_CHARS, MAX_ID_CHARS, MAX_STOP_TOKEN_IDS
from shared.messages.limits import MAX_TOKEN_ID
from shared.messages.streams import MAX_ITEM_TOKENS
from tests.support.worker_messages import worker_record, worker_telemetry

SP = SamplingParams(
    max_tokens=8,
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    seed=7,
    stop_token_ids=(2, 3),
    ignore_eos=True,
)

SAMPLES = {
    SamplingParams: SP,
    Ack: Ack(request_id="r1"),
    ErrorReply: ErrorReply(code="kv_capacity_exhausted", error="full", retry_after_ms=50),
    PrefillRequest: PrefillRequest(
        request_id="r1",
        router_id="rt0",
        prompt_token_ids=(1, 2, 3),
        sampling=SP,
        decode_worker_id="d0",
        arrival_time_s=10.0,
        ttft_deadline_s=10.5,
        tokens_subject="fluidpd.router.rt0.tokens",
        priority=1,
    ),
    AdmitRequest: AdmitRequest(
        request_id="r1",
        router_id="rt0",
        prompt_len=100,
        max_tokens=8,
        prefill_worker_id="p0",
        suffix_len=20,
        sampling=SP,
        tokens_subject="fluidpd.router.rt0.tokens",
        suffix_token_ids=tuple(range(20)),
    ),
    AdmitReply: AdmitReply(
        ok=True,
        transfer_id=2**64 - 1,
        block_ids=(4, 5),
        generations=(9, 2**40),
        ucx_address=b"\x00\x01ucx",
    ),
    CancelRequest: CancelRequest(request_id="r1", reason="client gone"),
    SwitchCommand: SwitchCommand(role="prefill"),
    SwitchReply: SwitchReply(ok=True, from_role="decode", to_role="prefill"),
    MigrateRequest: MigrateRequest(
        request_id="r1",
        router_id="rt0",
        tokens_subject="fluidpd.router.rt0.tokens",
        source_worker_id="d1",
        prompt_len=10,
        num_tokens=13,
        generated_token_ids=(5, 6, 7),
        sampling=SP,
        rng_offset=3,
    ),
    TokenItem: TokenItem(request_id="r1", token_ids=(5,), timestamps={"prefill_end_s": 1.5}),
    TokenLogprob: TokenLogprob(logprob=-0.25, top_ids=(5, 9), top_logprobs=(-0.25, -1.5)),
    TokenBatch: TokenBatch(
        publisher_id="d0",
        epoch=1,
        seq=0,
        items=(
            TokenItem(request_id="r1", token_ids=(5, 6)),
            TokenItem(
                request_id="r2",
                token_ids=(),
                finish_reason="error",
                error="boom",
                error_code="internal_error",
            ),
        ),
    ),
    WorkerTelemetry: worker_telemetry(
        "d0",
        "decode",
        seq=4,
        time_s=12.5,
        queue_len=3,
        running=12,
        free_blocks=100,
        total_blocks=400,
        dpi_load=0.4,
        dpi_adm=0.2,
        steal_budgets={"p0": 512},
        stolen_tokens_total=9000,
        metrics={"tpot_ms_p95": 31.5, "inf_check": float("inf")},
    ),
    StateEvent: StateEvent(
        publisher_id="d0",
        epoch=1,
        seq=0,
        time_s=1.0,
        role="decode",
        from_state="active",
        to_state="draining",
        reason="switch",
    ),
    ControllerDecision: ControllerDecision(
        publisher_id="ctl",
        epoch=1,
        seq=0,
        time_s=2.0,
        action="switch_d2p",
        target_worker_id="d3",
        reason="ppi persist",
        inputs={"ppi_p95": 1.4},
    ),
    StatusRequest: StatusRequest(role="decode"),
    WorkerRow: WorkerRow(
        worker_id="d0",
        role="decode",
        state="active",
        free_blocks=1,
        total_blocks=2,
        ppi=0.0,
        dpi_load=0.5,
        dpi_adm=0.1,
        stolen_tokens=0,
        pid=123,
        last_seen_s=0.02,
    ),
    StatusReply: StatusReply(auto=True, time_s=3.0),
    PolicyCommand: PolicyCommand(auto=False),
    PolicyReply: PolicyReply(ok=True, auto=False),
    SwitchLeaseRequest: SwitchLeaseRequest(worker_id="p1", from_role="prefill", to_role="decode"),
    SwitchLeaseReply: SwitchLeaseReply(ok=False, error="switch would leave no active prefill"),
    WorkerRecord: worker_record(
        "d0",
        "decode",
        ucx_address=b"\xff" * 40,
        model="tiny",
        fingerprint="abc",
        kv_total_blocks=100,
        max_model_len=2048,
        started_at_s=1.0,
        heartbeat_at_s=2.0,
        engine="emulated",
    ),
}


def test_samples_cover_every_message_type_and_tags_are_unique():
    assert set(SAMPLES) == set(ALL_MESSAGE_TYPES)
    assert len({t.TYPE_TAG for t in ALL_MESSAGE_TYPES}) == len(ALL_MESSAGE_TYPES)


@pytest.mark.parametrize("msg_type", ALL_MESSAGE_TYPES, ids=lambda t: t.TYPE_TAG)
def test_round_trip_msgpack_and_json(msg_type):
    msg = SAMPLES[msg_type]
    data = encode(msg)
    assert not is_json(data)
    assert decode(data, msg_type) == msg
    # JSON encoding works for every type; only JSON_ACCEPTED types take it back in.
    text = encode(msg, json_mode=True)
    assert is_json(text)
    if msg_type.JSON_ACCEPTED:
        assert decode(text, msg_type) == msg
    else:
        with pytest.raises(MessageError, match="msgpack"):
            decode(text, msg_type)


def test_operator_json_without_tag_or_version():
    assert decode(b'{"role":"prefill"}', SwitchCommand) == SwitchCommand(role="prefill")
    assert decode(b'  {"auto": true}\n', PolicyCommand) == PolicyCommand(auto=True)
    assert decode(b"", StatusRequest) == StatusRequest()
    assert decode(b"{}", StatusRequest) == StatusRequest()
    assert decode(b'{"request_id":"r9"}', CancelRequest).request_id == "r9"
    reply = json.loads(
        encode(SwitchReply(ok=True, from_role="decode", to_role="prefill"), json_mode=True)
    )
    assert reply["ok"] is True and reply["from"] == "decode" and reply["to"] == "prefill"
    assert "error" not in reply  # unset optional fields are left out of JSON


@pytest.mark.parametrize(
    "payload, why",
    [
        (b'{"role":"both"}', "one of"),
        (b'{"role":1}', "one of"),
        (b'{"role":"prefill","x":1}', "unknown"),
        (b"{}", "missing"),
        (b'{"role":"prefill","_t":"policy_command"}', "expected switch_command"),
        (b'{"role":"prefill","_v":2}', "version"),
        (b'{"role":"prefill","_v":true}', "version"),
        (b'{"role":', "invalid JSON"),
        (b'{"role":"prefill"} trailing', "invalid JSON"),
        (b"[1,2]", "invalid msgpack"),
        (b"\xc1", "invalid msgpack"),
        (b"\x93\x01\x02\x03", "must be a map"),
    ],
)
def test_invalid_switch_payloads(payload, why):
    with pytest.raises(MessageError, match=why):
        decode(payload, SwitchCommand)


def test_strict_field_types():
    good = msgpack.packb({"_t": "policy_command", "_v": 1, "auto": True})
    assert decode(good, PolicyCommand).auto is True
    for bad in (1, "true", None, 0.0):
        data = msgpack.packb({"_t": "policy_command", "_v": 1, "auto": bad})
        with pytest.raises(MessageError):
            decode(data, PolicyCommand)
    # bool is not an int, NaN is not a number, floats accept ints
    with pytest.raises(MessageError):
        decode(b'{"request_id":"r","reason":true}', CancelRequest)
    with pytest.raises(MessageError, match="not allowed"):
        decode(b'{"auto":NaN}', PolicyCommand)
    row = dict(encode_fields(SAMPLES[WorkerRow]), pid=True)
    with pytest.raises(MessageError, match="pid"):
        decode(msgpack.packb({**row, "_t": "worker_row", "_v": 1}), WorkerRow)
    row = dict(encode_fields(SAMPLES[WorkerRow]), ppi=1)
    assert decode(msgpack.packb({**row, "_t": "worker_row", "_v": 1}), WorkerRow).ppi == 1.0
    # msgpack messages must carry tag and version
    with pytest.raises(MessageError, match="tag"):
        decode(msgpack.packb({"auto": True}), PolicyCommand)
    with pytest.raises(MessageError, match="version"):
        decode(msgpack.packb({"_t": "policy_command", "auto": True}), PolicyCommand)
    # lone surrogates would crash any later encode: refused at the door
    with pytest.raises(MessageError, match="unicode"):
        decode(b'{"request_id":"\\ud800"}', CancelRequest)
    # over-long strings
    with pytest.raises(MessageError, match="longer"):
        decode(json.dumps({"request_id": "r" * (MAX_ID_CHARS + 1)}).encode(), CancelRequest)


def encode_fields(msg):
    fields = msgpack.unpackb(encode(msg))
    del fields["_t"], fields["_v"]
    return fields


def test_semantic_checks():
    with pytest.raises(MessageError, match="top_p"):
        SamplingParams(top_p=0.0).check()
    base = encode_fields(SAMPLES[PrefillRequest])
    bad = {**base, "prompt_token_ids": [1, -1], "_t": "prefill_request", "_v": 1}
    with pytest.raises(MessageError, match="token ids"):
        decode(msgpack.packb(bad), PrefillRequest)
    bad = {**base, "prompt_token_ids": [2**32], "_t": "prefill_request", "_v": 1}
    with pytest.raises(MessageError, match="token ids"):
        decode(msgpack.packb(bad), PrefillRequest)
    with pytest.raises(MessageError, match="lengths"):
        encode(AdmitReply(ok=True, block_ids=(1,), generations=()))
    with pytest.raises(MessageError, match="error"):
        encode(SwitchReply(ok=False))
    assert isinstance(MessageError("x"), InvalidRequestError)


def test_decode_reply_distinguishes_error_replies():
    ok = decode_reply(encode(SAMPLES[SwitchReply]), SwitchReply)
    assert isinstance(ok, SwitchReply)
    err = decode_reply(encode(ErrorReply(code="c", error="e")), SwitchReply)
    assert isinstance(err, ErrorReply) and err.code == "c"
    err = decode_reply(b'{"ok":false,"code":"c","error":"e"}', SwitchReply)
    assert isinstance(err, ErrorReply)
    with pytest.raises(MessageError):
        decode_reply(encode(Ack()), SwitchReply)


# --- size bounds --------------------------------------------------------------------------


def test_worst_case_prefill_and_migrate_fit_by_construction():
    long_id = "\U0001f600" * MAX_ID_CHARS  # 4 UTF-8 bytes per char
    sampling = SamplingParams(
        max_tokens=2**31, seed=2**63, stop_token_ids=(MAX_TOKEN_ID,) * MAX_STOP_TOKEN_IDS
    )
    tokens = (MAX_TOKEN_ID,) * MAX_WIRE_TOKEN_IDS
    prefill = PrefillRequest(
        request_id=long_id,
        router_id=long_id,
        prompt_token_ids=tokens,
        sampling=sampling,
        decode_worker_id=long_id,
        arrival_time_s=1e12,
        ttft_deadline_s=1e12 + 1,
        tokens_subject="\U0001f600" * 256,
        priority=-(2**63),
    )
    assert len(encode(prefill)) <= MAX_MESSAGE_BYTES
    migrate = MigrateRequest(
        request_id=long_id,
        router_id=long_id,
        tokens_subject="\U0001f600" * 256,
        source_worker_id=long_id,
        prompt_len=2**40,
        num_tokens=MAX_WIRE_TOKEN_IDS,
        generated_token_ids=tokens,
        sampling=sampling,
        rng_offset=2**63,
    )
    assert len(encode(migrate)) <= MAX_MESSAGE_BYTES
    admit = AdmitReply(
        ok=False,
        transfer_id=2**64 - 1,
        block_ids=(MAX_TOKEN_ID,) * MAX_WIRE_BLOCKS,
        generations=(2**64 - 1,) * MAX_WIRE_BLOCKS,
        ucx_address=b"\xff" * 65536,
        error="\U0001f600" * MAX_ERROR_CHARS,
        retry_after_ms=2**63,
    )
    assert len(encode(admit)) <= MAX_MESSAGE_BYTES
    # one token more than the bound is refused by validation (not by a timeout later)
    with pytest.raises(MessageError):
        encode(PrefillRequest(**{**prefill.__dict__, "prompt_token_ids": (*tokens, 1)}))
    check_context_fits(MAX_WIRE_TOKEN_IDS)
    with pytest.raises(ContextLengthError):
        check_context_fits(MAX_WIRE_TOKEN_IDS + 1)


def test_encode_refuses_oversized_messages():
    items = tuple(
        TokenItem(request_id=f"r{i}", token_ids=(MAX_TOKEN_ID,) * 100) for i in range(2000)
    )
    batch = TokenBatch(publisher_id="d0", epoch=1, seq=0, items=items)
    with pytest.raises(MessageTooLargeError):
        encode(batch)
    with pytest.raises(MessageTooLargeError):
        encode(SAMPLES[SwitchCommand], max_bytes=8)
    with pytest.raises(MessageError, match="exceeds"):
        decode(b"\x80" + b" " * MAX_MESSAGE_BYTES, SwitchCommand)


def test_pack_token_batches_splits_under_the_limit_and_keeps_order():
    sequencer = StreamSequencer("d0", epoch=5)
    items = [TokenItem(request_id=f"req-{i}", token_ids=(MAX_TOKEN_ID,) * 100) for i in range(2000)]
    items.append(
        TokenItem(
            request_id="long",
            token_ids=tuple(range(MAX_ITEM_TOKENS * 2 + 5)),
            finish_reason="length",
        )
    )
    items.append(TokenItem(request_id="err", finish_reason="error", error="x" * 100_000))
    batches = pack_token_batches(sequencer, "router.rt0", items)
    assert len(batches) > 1
    assert [b.seq for b in batches] == list(range(len(batches)))
    assert all(b.epoch == 5 and b.publisher_id == "d0" for b in batches)
    for batch in batches:
        assert len(encode(batch)) <= MAX_MESSAGE_BYTES
    flat = [item for b in batches for item in b.items]
    long_pieces = [i for i in flat if i.request_id == "long"]
    assert len(long_pieces) == 3
    assert sum((p.token_ids for p in long_pieces), ()) == tuple(range(MAX_ITEM_TOKENS * 2 + 5))
    assert [p.finish_reason for p in long_pieces] == [None, None, "length"]
    assert [i.request_id for i in flat if i.request_id.startswith("req-")] == [
        f"req-{i}" for i in range(2000)
    ]
    err = next(i for i in flat if i.request_id == "err")
    assert len(err.error) == MAX_ERROR_CHARS
    assert pack_token_batches(sequencer, "router.rt0", []) == []
    # the next batch on the same stream continues the sequence; another stream starts at 0
    assert pack_token_batches(sequencer, "router.rt0", items[:1])[0].seq == len(batches)
    assert pack_token_batches(sequencer, "router.rt1", items[:1])[0].seq == 0


# --- sequence tracking --------------------------------------------------------------------


def test_sequence_tracker_gaps_duplicates_and_restarts():
    tracker = SequenceTracker()
    assert tracker.observe("p", 1, 10).accepted  # first seen: any seq
    assert tracker.observe("p", 1, 11) == Observation(accepted=True, gap=0, restarted=False)
    assert tracker.observe("q", 1, 0).accepted  # publishers are independent
    gap = tracker.observe("p", 1, 14)
    assert gap.accepted and gap.gap == 2
    assert not tracker.observe("p", 1, 14).accepted  # duplicate
    assert not tracker.observe("p", 1, 12).accepted  # reordered old
    restart = tracker.observe("p", 2, 0)
    assert restart.accepted and restart.restarted and restart.gap == 0
    assert not tracker.observe("p", 1, 15).accepted  # late message from a dead incarnation
    assert tracker.observe("p", 2, 1).accepted
    assert tracker.gaps_total == 2 and tracker.dropped_total == 3
    tracker.forget("p")
    assert "p" not in tracker.publishers()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=80))
def test_sequence_tracker_property(seqs):
    tracker = SequenceTracker()
    accepted = []
    gaps = 0
    for seq in seqs:
        obs = tracker.observe("p", 1, seq)
        if obs.accepted:
            accepted.append(seq)
            gaps += obs.gap
    assert accepted == sorted(set(accepted))  # strictly increasing: no dupes, no reorder
    assert accepted[0] == seqs[0]
    assert gaps == accepted[-1] - accepted[0] + 1 - len(accepted)


# --- property tests on the codec ----------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)
CONTROL_TYPES = [t for t in ALL_MESSAGE_TYPES if t.JSON_ACCEPTED]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    msg_type=st.sampled_from(CONTROL_TYPES),
    obj=st.dictionaries(
        st.sampled_from(
            [
                "role",
                "auto",
                "request_id",
                "reason",
                "ok",
                "code",
                "error",
                "from",
                "to",
                "_t",
                "_v",
                "x",
            ]
        )
        | st.text(),
        json_values,
        max_size=5,
    ),
)
def test_random_json_is_a_message_or_a_message_error(msg_type, obj):
    data = json.dumps(obj).encode()
    try:
        msg = decode(data, msg_type)
    except MessageError:
        return
    assert isinstance(msg, msg_type)
    assert decode(encode(msg, json_mode=True), msg_type) == msg  # valid ⇒ re-encodable


@settings(max_examples=150, deadline=None)
@given(msg_type=st.sampled_from(ALL_MESSAGE_TYPES), data=st.binary(max_size=200))
def test_random_bytes_never_escape_as_other_errors(msg_type, data):
    try:
        msg = decode(data, msg_type)
    except MessageError:
        return
    assert isinstance(msg, msg_type)


sampling_st = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 4096),
    temperature=st.floats(0, 2),
    top_p=st.floats(0.01, 1),
    top_k=st.integers(0, 100),
    seed=st.none() | st.integers(0, 2**63),
    stop_token_ids=st.lists(st.integers(0, MAX_TOKEN_ID), max_size=5).map(tuple),
    ignore_eos=st.booleans(),
)


@settings(max_examples=50, deadline=None)
@given(
    sampling=sampling_st,
    tokens=st.lists(st.integers(0, MAX_TOKEN_ID), min_size=1, max_size=300).map(tuple),
    request_id=st.text(min_size=1, max_size=MAX_ID_CHARS),
)
def test_prefill_request_round_trip_property(sampling, tokens, request_id):
    msg = PrefillRequest(
        request_id=request_id,
        router_id="rt",
        prompt_token_ids=tokens,
        sampling=sampling,
        decode_worker_id="d0",
        arrival_time_s=1.0,
        ttft_deadline_s=2.0,
        tokens_subject="s",
    )
    assert decode(encode(msg), PrefillRequest) == msg


@settings(max_examples=50, deadline=None)
@given(
    metrics=st.dictionaries(st.text(max_size=30), st.floats(allow_nan=False), max_size=20),
    budgets=st.dictionaries(st.text(max_size=30), st.integers(0, 2**40), max_size=10),
    seq=st.integers(0, 2**63),
)
def test_telemetry_round_trip_property(metrics, budgets, seq):
    msg = worker_telemetry(
        "p0",
        "prefill",
        seq=seq,
        time_s=1.0,
        free_blocks=0,
        total_blocks=0,
        ppi=1.5,
        steal_budgets=budgets,
        metrics=metrics,
    )
    assert decode(encode(msg), WorkerTelemetry) == msg


# --- subjects -----------------------------------------------------------------------------


def test_subjects():
    s = Subjects()
    assert s.worker_switch("w3") == "fluidpd.worker.w3.switch"
    assert s.worker_prefill("p-0") == "fluidpd.worker.p-0.prefill"
    assert s.router_tokens("rt_1") == "fluidpd.router.rt_1.tokens"
    assert s.telemetry("decode", "d0") == "fluidpd.telemetry.decode.d0"
    assert s.telemetry("*", "*") == "fluidpd.telemetry.*.*"
    assert s.events("d0") == "fluidpd.events.d0"
    assert s.controller_policy() == "fluidpd.controller.policy"
    assert s.registry_bucket() == "fluidpd_registry"
    other = Subjects(prefix="lab.a")
    assert other.controller_status() == "lab.a.controller.status"
    assert other.registry_bucket() == "lab_a_registry"
    for bad in ("a.b", "", "x y", ">", "w*"):
        with pytest.raises(ValueError):
            s.worker_switch(bad)
    with pytest.raises(ValueError):
        Subjects(prefix="bad..prefix")
    with pytest.raises(ValueError):
        s.telemetry("both", "w1")
    assert s.pattern("fluidpd.worker.w3.switch") == "worker.*.switch"
    assert s.pattern("fluidpd.telemetry.decode.d9") == "telemetry.decode.*"
    assert s.pattern("fluidpd.router.r1.tokens") == "router.*.tokens"
    assert s.pattern(s.telemetry("*", "*")) == "telemetry.*.*"
    assert s.telemetry_all() == "fluidpd.telemetry.*.*"  # subscription = permission
    assert s.pattern("fluidpd.controller.status") == "controller.status"
    assert s.pattern("other.worker.w3.switch") == "other"
    assert s.pattern("fluidpd.worker.w3.bogus") == "other"


def test_pack_token_batches_splits_logprobs_with_their_tokens():
    """Prompt logprobs (echo) of a long prompt travel in pieces that fit, in order, and
    per-token logprobs stay with their tokens."""
    lp = TokenLogprob(logprob=-1.0, top_ids=tuple(range(20)), top_logprobs=(-1.0,) * 20)
    n_prompt = 3000
    item = TokenItem(
        request_id="e",
        token_ids=(7,),
        logprobs=(lp,),
        prompt_logprobs_start=1,
        prompt_logprobs=tuple(
            TokenLogprob(logprob=-float(i), top_ids=(1,), top_logprobs=(-0.5,))
            for i in range(n_prompt)
        ),
    )
    batches = pack_token_batches(StreamSequencer("p0", epoch=1), "router.rt0", [item])
    for batch in batches:
        assert len(encode(batch)) <= MAX_MESSAGE_BYTES
    flat = [i for b in batches for i in b.items]
    got = {}
    for piece in flat:
        for j, plp in enumerate(piece.prompt_logprobs):
            assert piece.prompt_logprobs_start + j not in got
            got[piece.prompt_logprobs_start + j] = plp.logprob
    assert got == {1 + i: -float(i) for i in range(n_prompt)}
    assert [p.token_ids for p in flat if p.token_ids] == [(7,)]
    assert [p.logprobs for p in flat if p.token_ids] == [(lp,)]
    with pytest.raises(MessageError):
        encode(TokenItem(request_id="x", token_ids=(1, 2), logprobs=(lp,)))
