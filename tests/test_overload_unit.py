"""Unit tests of the overload parts that need no processes: the decode worker's count of
waiting admissions, the prefill side's choice of a decode worker with room, the router's
admission gate (predicted TTFT, 503 + Retry-After), the flags' validation, the errors a
failed stream end maps to, and the replay summary's rejected / failed-after-accept split."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from services.bench.loadgen import RequestRecord
from services.bench.replay_metrics import attainment
from services.bench.replay_run import RunSpec, cluster_spec
from services.router.__main__ import main as router_main
from services.router.__main__ import parse_hold_s
from services.router.admission import AdmissionGate, Overloaded
from services.router.config import STREAM_HOLD_AUTO_MARGIN_S, RouterConfig
from services.router.errors import end_to_error
from services.router.streams import StreamEnd
from services.sim.config import SimConfig, config_for
from services.worker.config import WorkerConfig
from services.worker.decode.decode_waiting import WaitingAdmissions, WaitingTotals
from services.worker.decode_choice import DecodeView, pick_with_capacity
from services.worker.main import main as worker_main
from shared.engine.profiles import load_profile
from shared.messages import Role, WorkerRecord, WorkerTelemetry
from shared.policy.admission import (
    DEFAULT_EXPIRE_MARGIN_S,
    PAPER_ABORT_AFTER_S,
    SheddingConfig,
)
from tests.support.worker_messages import worker_record, worker_telemetry

PROFILE = load_profile("")  # T_pre(L) = 93.5 us * L + 15 ms


def record(worker_id: str, role: Role = "decode", *, max_num_seqs: int = 4) -> WorkerRecord:
    return worker_record(worker_id, role, decode_reserve_tokens=32, max_num_seqs=max_num_seqs)


def telemetry(
    worker_id: str, *, seq: int = 0, queue_work_s: float | None = 0.0, role: Role = "prefill"
) -> WorkerTelemetry:
    metrics = {} if queue_work_s is None else {"queue_work_s": queue_work_s}
    metrics |= {"prefill_c1_s_per_token": 1e-3, "prefill_c0_s": 0.01}
    return worker_telemetry(worker_id, role, seq=seq, metrics=metrics)


# ------------------------------------------------------------------- waiting admissions
def test_waiting_admissions_count_until_admitted_cancelled_or_silent() -> None:
    w = WaitingAdmissions(ttl_s=1.0)
    w.note("a", 100, now_s=0.0)
    w.note("b", 50, now_s=0.5)
    assert (w.totals(0.6).requests, w.totals(0.6).kv_tokens) == (2, 150)
    w.note("a", 100, now_s=0.9)  # a retry refreshes it: counted once
    assert w.totals(1.2).requests == 2
    assert w.totals(1.6).requests == 1  # b stopped retrying (re-paired, timed out)
    w.drop("a")  # admitted or cancelled
    assert (w.totals(1.6).requests, w.totals(1.6).kv_tokens) == (0, 0)


def test_waiting_admissions_are_served_in_the_order_they_first_asked() -> None:
    w = WaitingAdmissions(ttl_s=1.0)
    w.note("old", 100, now_s=0.0)
    w.note("new", 50, now_s=0.1)
    w.note("old", 100, now_s=0.2)  # a retry keeps its place
    assert w.ahead("old", now_s=0.3) == WaitingTotals(0, 0)
    assert w.ahead("new", now_s=0.3) == WaitingTotals(1, 100)
    assert w.ahead("stranger", now_s=0.3) == WaitingTotals(2, 150)  # not waiting yet: last
    assert w.ahead("new", now_s=1.25) == WaitingTotals(0, 0)  # "old" went silent
    with pytest.raises(ValueError):
        WaitingAdmissions(ttl_s=0.0)


# -------------------------------------------------------------- decode choice (re-pair)
def test_pick_with_capacity_needs_fresh_telemetry_a_free_slot_and_the_kv() -> None:
    recs = [record("d1"), record("d2"), record("d3")]
    views = {
        "d1": DecodeView(received_s=10.0, free_blocks=100, admitted=4, waiting=0),  # no slot
        "d2": DecodeView(received_s=10.0, free_blocks=20, admitted=1, waiting=0),
        "d3": DecodeView(received_s=9.0, free_blocks=128, admitted=0, waiting=0),  # stale
    }
    kw = {"prompt_tokens": 100, "max_tokens": 50}  # (100 + 32) tokens = 9 blocks
    assert pick_with_capacity(recs, views, 10.1, **kw) == "d2"
    assert pick_with_capacity(recs, views, 10.1, exclude=frozenset({"d2"}), **kw) is None
    # Slots already promised to waiting requests are not free.
    views["d2"] = dataclasses.replace(views["d2"], waiting=3)
    assert pick_with_capacity(recs, views, 10.1, **kw) is None
    # Neither is the KV those waiting requests would reserve.
    views["d2"] = DecodeView(10.0, free_blocks=20, admitted=0, waiting=1, waiting_blocks=12)
    assert pick_with_capacity(recs, views, 10.1, **kw) is None
    views["d3"] = dataclasses.replace(views["d3"], received_s=10.0)
    assert pick_with_capacity(recs, views, 10.1, **kw) == "d3"


# ------------------------------------------------------------------------ router gate
def gate(multiple: float = 2.0) -> AdmissionGate:
    return AdmissionGate(
        SheddingConfig(ttft_multiple=multiple, expire_margin_s=None),
        1.0,
        stale_after_s=1.0,
        profile=PROFILE,
    )


def test_gate_predicts_ttft_on_the_given_prefill_worker_with_its_coefficients() -> None:
    g = gate()
    assert g.predict_s(1000, "p1", now_s=0.0) is None  # no telemetry: no prediction
    g.check(10**6, "p1", now_s=0.0)  # ... and no shedding
    g.observe(telemetry("p1", queue_work_s=5.0), now_s=0.0)
    g.observe(telemetry("p2", queue_work_s=1.0), now_s=0.0)
    # Each worker its own queue + the request's T_pre(1000) = 1e-3 * 1000 + 0.01 (published).
    assert g.predict_s(1000, "p1", now_s=0.1) == pytest.approx(6.01)
    assert g.predict_s(1000, "p2", now_s=0.1) == pytest.approx(2.01)
    assert g.predict_s(1000, "p9", now_s=0.1) is None  # never heard from
    # What this router sent since p2's telemetry counts there until the next one shows it.
    g.note_sent("p2", 2000, now_s=0.2)
    assert g.predict_s(1000, "p2", now_s=0.3) == pytest.approx(4.02)  # (1 + 2.01) + 1.01
    assert g.predict_s(1000, "p1", now_s=0.3) == pytest.approx(6.01)  # not sent to p1
    g.observe(telemetry("p2", seq=1, queue_work_s=3.01), now_s=0.4)
    assert g.predict_s(1000, "p2", now_s=0.5) == pytest.approx(4.02)  # not counted twice
    assert g.predict_s(1000, "p2", now_s=1.35) == pytest.approx(4.02)
    assert g.predict_s(1000, "p1", now_s=1.35) is None  # p1's telemetry is stale
    assert g.predict_s(1000, "p2", now_s=1.5) is None


def test_gate_sheds_above_the_multiple_with_retry_after_and_never_when_off() -> None:
    g = gate(multiple=2.0)
    g.observe(telemetry("p1", queue_work_s=1.5), now_s=0.0)
    g.observe(telemetry("p2", queue_work_s=3.0), now_s=0.0)
    g.check(400, "p1", now_s=0.0)  # 1.5 + 0.41 = 1.91 s <= 2 x 1 s
    with pytest.raises(Overloaded) as info:
        g.check(1000, "p1", now_s=0.0)  # 1.5 + 1.01 = 2.51 s > 2 s
    err = info.value
    assert (err.http_status, err.code, err.retry_after_s) == (503, "overloaded", 1)
    assert "2.5 s" in err.message and g.shed_total == 1
    with pytest.raises(Overloaded) as info:
        g.check(4000, "p1", now_s=0.0)  # 1.5 + 4.01 = 5.51 s: 3.51 s over the limit
    assert info.value.retry_after_s == 4
    # The same request the idle-enough p1 admits is shed on p2: 3.0 + 0.41 = 3.41 s.
    with pytest.raises(Overloaded):
        g.check(400, "p2", now_s=0.0)
    assert g.shed_total == 3
    g.check(400, "p3", now_s=0.0)  # no telemetry from p3: no prediction, admitted
    off = gate(multiple=0.0)
    off.observe(telemetry("p1", queue_work_s=100.0), now_s=0.0)
    off.check(10**5, "p1", now_s=0.0)  # off: never sheds
    # A worker that is no longer a prefill worker (or publishes no queue) is forgotten.
    g.observe(telemetry("p1", seq=1, queue_work_s=None), now_s=0.1)
    g.observe(telemetry("p2", seq=1, role="decode"), now_s=0.1)
    assert g.predict_s(1000, "p1", now_s=0.2) is None
    assert g.predict_s(1000, "p2", now_s=0.2) is None


def test_gate_sheds_when_every_decode_worker_has_a_batch_of_requests_waiting() -> None:
    decode = [record("d1", max_num_seqs=4), record("d2", max_num_seqs=8)]
    g = AdmissionGate(
        # The TTFT rule off; the backlog rule at one batch.
        SheddingConfig(ttft_multiple=0.0, expire_margin_s=None, decode_backlog_batches=1.0),
        1.0,
        stale_after_s=1.0,
        profile=PROFILE,
        decode_records=lambda: decode,
    )

    def waiting(wid: str, n: int, seq: int) -> WorkerTelemetry:
        return dataclasses.replace(
            telemetry(wid, seq=seq, role="decode"), metrics={"decode_waiting": float(n)}
        )

    g.check(1000, "p1", now_s=0.0)  # no decode telemetry: nothing to go on
    g.observe(waiting("d1", 4, 0), now_s=0.0)  # one batch waiting on d1 ...
    g.observe(waiting("d2", 7, 0), now_s=0.0)  # ... but d2 still below one batch
    assert g.decode_backlog(now_s=0.1) == pytest.approx(7 / 8)
    g.check(1000, "p1", now_s=0.1)
    g.observe(waiting("d2", 16, 1), now_s=0.2)  # two batches
    with pytest.raises(Overloaded) as info:
        g.check(1000, "p1", now_s=0.3)
    assert (info.value.code, info.value.retry_after_s) == ("overloaded", 1)
    assert "decode worker" in info.value.message
    g.check(1000, "p1", now_s=1.5)  # stale: no longer evidence
    with pytest.raises(ValueError):
        AdmissionGate(SheddingConfig(decode_backlog_batches=-1.0), 1.0)


def test_failed_ends_before_any_token_map_to_503_with_retry_after() -> None:
    for code in ("deadline_expired", "decode_wait_timeout", "kv_capacity_exhausted"):
        err = end_to_error(StreamEnd("error", "x", code))
        assert (err.http_status, err.code, err.retry_after_s) == (503, code, 1)


# ------------------------------------------------------------------------------ flags
def test_stream_header_hold_flag_and_its_automatic_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    auto = RouterConfig(ttft_slo_ms=2000.0)
    assert auto.stream_header_hold_s is None
    assert auto.header_hold_s == 2.0 + STREAM_HOLD_AUTO_MARGIN_S
    # The automatic hold outlasts the prefill worker's default expiry margin: a request
    # dropped at its default deadline + margin still gets its 503 before any 200.
    monkeypatch.setenv("FLUIDPD_CLUSTER_SECRET", "test-secret")
    worker = WorkerConfig(worker_id="p0", role="prefill", cluster_secret="s")
    assert worker.expire_margin is not None and worker.expire_margin < STREAM_HOLD_AUTO_MARGIN_S
    assert RouterConfig(stream_header_hold_s=0.0).header_hold_s == 0.0  # headers at once
    assert RouterConfig(stream_header_hold_s=3.5).header_hold_s == 3.5
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="stream_header_hold_s"):
            RouterConfig(stream_header_hold_s=bad)
    assert parse_hold_s("auto") is None and parse_hold_s("0") == 0.0
    for argv in (["--stream-header-hold-s", "-2"], ["--stream-header-hold-s", "soon"]):
        assert router_main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "stream" in err, err
    monkeypatch.setenv("FLUIDPD_STREAM_HEADER_HOLD_S", "later")
    assert router_main([]) == 2
    assert "--stream-header-hold-s" in capsys.readouterr().err


def test_router_and_worker_flags_validate_and_bad_values_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert RouterConfig(shed_ttft_multiple=0.0).shed_ttft_multiple == 0.0
    assert RouterConfig().shed_ttft_multiple == 1.0
    assert RouterConfig(shed_decode_backlog=0.0).shed_decode_backlog == 0.0
    for bad_backlog in (-1.0, float("inf"), float("nan")):  # SheddingConfig's range
        with pytest.raises(ValueError, match="shed_decode_backlog"):
            RouterConfig(shed_decode_backlog=bad_backlog)
    assert router_main(["--shed-decode-backlog", "inf"]) == 2
    assert capsys.readouterr().err.count("\n") == 1  # one line, not a traceback
    # The gate gets both knobs in one SheddingConfig; expiry is the prefill workers'.
    shedding = RouterConfig(shed_ttft_multiple=3.0, shed_decode_backlog=2.5).shedding
    assert shedding == SheddingConfig(3.0, expire_margin_s=None, decode_backlog_batches=2.5)
    with pytest.raises(ValueError, match="shed_ttft_multiple"):
        RouterConfig(shed_ttft_multiple=0.5)
    assert router_main(["--shed-ttft-multiple", "0.5"]) == 2
    assert capsys.readouterr().err.count("\n") == 1  # one line
    monkeypatch.setenv("FLUIDPD_SHED_TTFT_MULTIPLE", "lots")
    assert router_main([]) == 2
    assert "could not convert" in capsys.readouterr().err
    monkeypatch.delenv("FLUIDPD_SHED_TTFT_MULTIPLE")

    monkeypatch.setenv("FLUIDPD_CLUSTER_SECRET", "test-secret")  # workers refuse to start without
    cfg = WorkerConfig(worker_id="p0", role="prefill", cluster_secret="s")
    # The expiry margin is the one default of shared/policy/admission.py (the simulator's).
    assert (cfg.decode_wait_timeout_s, cfg.expire_margin) == (60.0, DEFAULT_EXPIRE_MARGIN_S)
    assert SheddingConfig().expire_margin_s == DEFAULT_EXPIRE_MARGIN_S == 5.0
    assert (
        WorkerConfig(
            worker_id="p0", role="prefill", cluster_secret="s", expire_margin_s=-1
        ).expire_margin
        is None
    )
    with pytest.raises(ValueError, match="decode_wait_timeout_s"):
        WorkerConfig(worker_id="p0", role="prefill", cluster_secret="s", decode_wait_timeout_s=0.0)
    with pytest.raises(ValueError, match="expire_margin_s"):
        WorkerConfig(
            worker_id="p0", role="prefill", cluster_secret="s", expire_margin_s=float("nan")
        )
    assert worker_main("prefill", ["--decode-wait-timeout-s", "0"]) == 2
    monkeypatch.setenv("FLUIDPD_EXPIRE_MARGIN_S", "soon")
    assert worker_main("prefill", []) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "decode_wait_timeout_s" in err


# ------------------------------------------------------------------------ replay bench
def replay_record(
    status: int,
    error: str | None,
    first_token_s: float | None,
    last_token_s: float | None = None,
    num_tokens: int = 1,
) -> RequestRecord:
    """One load generator record arriving at 0 s (no tokens when ``first_token_s`` is None)."""
    return RequestRecord(
        index=0,
        label="0:w",
        arrival_s=0.0,
        prompt_tokens=8,
        output_tokens=num_tokens,
        first_token_s=first_token_s,
        last_token_s=first_token_s if last_token_s is None else last_token_s,
        num_tokens=0 if first_token_s is None else num_tokens,
        error=error,
        status=status,
    )


def test_replay_summary_reports_rejected_apart_from_failed_after_accept() -> None:
    rec = replay_record
    records = [
        rec(200, None, 0.1),
        rec(503, "http 503: overloaded", None),
        rec(503, "http 503: deadline_expired", None),
        rec(200, "decode worker has no capacity", 0.1),
    ]
    row = attainment(records, slo_ttft_ms=1000, slo_tpot_ms=1000)
    assert (row["rejected"], row["rejected_fraction"]) == (2, 0.5)
    assert (row["failed_after_accept"], row["failed_after_accept_fraction"]) == (1, 0.25)
    assert row["errors"] == 3 and row["joint_attainment"] == 0.25  # rejected: not attained


def test_replay_summary_counts_a_tpot_miss_after_a_met_ttft() -> None:
    # TPOT (last - first) / 2: 0.05 s, 2.5 s (waited for decode), 0.05 s after a late first token.
    records = [
        replay_record(200, None, t0, t1, num_tokens=3)
        for t0, t1 in [(0.1, 0.2), (0.1, 5.1), (3.0, 3.1)]
    ]
    row = attainment(records, slo_ttft_ms=1000, slo_tpot_ms=1000)
    assert row["tpot_missed_after_ttft"] == 1  # the late first token is a TTFT miss, not this
    assert row["joint_attainment"] == round(1 / 3, 4)


def test_replay_clusters_hold_stream_headers_past_the_scaled_expiry(tmp_path: Path) -> None:
    """`fluidpd bench replay` scales the TTFT SLO and the expiry margin by --time-scale; the
    router's hold must outlast both, or a deadline drop would be an in-band error again."""
    for scale, margin_s in ((1.0, 10.0), (10.0, 10.0), (1.0, 30.0)):
        spec = RunSpec(
            "full", time_scale=scale, slo_ttft_ms=2000.0, expire_margin_s=margin_s, out_dir=tmp_path
        )
        args = cluster_spec(spec).router_args
        hold_s = float(args[args.index("--stream-header-hold-s") + 1])
        assert hold_s > (2.0 + margin_s) * scale, (scale, margin_s, hold_s)
    never = RunSpec("full", expire_margin_s=-1.0, out_dir=tmp_path)
    assert "--stream-header-hold-s" not in cluster_spec(never).router_args  # automatic


def test_replay_cluster_defaults_match_the_simulator_shedding(tmp_path: Path) -> None:
    """A RunSpec built without shedding knobs (the cross-check's emulated side) must shed and
    expire exactly like the simulator's default SimConfig, scaled by --time-scale; a drifted
    default made the two sides of the cross-check run different rules."""
    sim = SimConfig(workers=8).shedding
    spec = RunSpec("full", time_scale=2.0, out_dir=tmp_path)
    workers, router = cluster_spec(spec).worker_args, cluster_spec(spec).router_args
    assert sim.expire_margin_s is not None
    margin_s = float(workers[workers.index("--expire-margin-s") + 1])
    assert margin_s == sim.expire_margin_s * 2.0
    assert float(router[router.index("--shed-ttft-multiple") + 1]) == sim.ttft_multiple
    assert float(router[router.index("--shed-decode-backlog") + 1]) == sim.decode_backlog_batches


def test_replay_static_paper_is_the_papers_baseline_whatever_the_shedding_flags(
    tmp_path: Path,
) -> None:
    """`static-paper` runs the paper's SGLang-like baseline (no door, queued work aborted 60 s
    trace time after arrival, round robin, no FluidToken/FluidRole) even when the spec's
    shedding fields say otherwise, and matches the simulator's configuration of that name."""
    spec = RunSpec(
        "static-paper",
        time_scale=2.0,
        slo_ttft_ms=2000.0,
        shed_ttft_multiple=3.0,
        shed_decode_backlog=1.0,
        expire_margin_s=10.0,
        out_dir=tmp_path,
    )
    cs = cluster_spec(spec)
    workers, router = cs.worker_args, cs.router_args
    sim = config_for("static-paper", SimConfig(workers=8)).shedding
    assert sim.expire_margin_s is not None
    margin_s = float(workers[workers.index("--expire-margin-s") + 1])
    assert margin_s == (PAPER_ABORT_AFTER_S - 2.0) * 2.0 == sim.expire_margin_s * 2.0
    assert float(router[router.index("--shed-ttft-multiple") + 1]) == sim.ttft_multiple == 0.0
    assert float(router[router.index("--shed-decode-backlog") + 1]) == 0.0
    assert router[router.index("--pairing") + 1] == "round_robin"
    assert "--no-fluidtoken" in workers and not cs.auto_policy
    hold_s = float(router[router.index("--stream-header-hold-s") + 1])
    assert hold_s > PAPER_ABORT_AFTER_S * 2.0  # a 60 s abort is a 503, not an in-band error
    # The other configurations keep the spec's own fields.
    full = cluster_spec(dataclasses.replace(spec, config="full")).router_args
    assert float(full[full.index("--shed-ttft-multiple") + 1]) == 3.0
    assert "--pairing" not in full
