"""Pressure-aware pairing between two telemetry messages (services/router/pairing.py).

Numbers are chosen to be exact in binary floating point so that ties are real ties:
T_pre(L) = L / 1024 s, S_TTFT = 1 s, so a 128-token prompt raises a prefill worker's
estimated PPI by 0.125; a decode worker has 128 blocks of 16 tokens, and a 128-token prompt
with max_tokens 128 reserves 256 tokens = 16 blocks = 0.125 of its KV.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from services.router.pairing import RoundRobinPolicy
from services.router.pressure_pairing import (
    PressureConfig,
    PressurePolicy,
    make_policy,
)
from shared.messages import Role, WorkerTelemetry
from shared.policy.pairing import decode_score, prefill_score
from shared.policy.predictors import example_profile
from tests.support.worker_messages import worker_record, worker_telemetry

PROFILE = dataclasses.replace(example_profile(), prefill_c1_s_per_token=1 / 1024, prefill_c0_s=0.0)
T0 = 1000.0  # monotonic seconds of the first telemetry in each test


def telemetry(
    worker_id: str,
    role: Role,
    *,
    seq: int = 0,
    ppi: float = 0.0,
    dpi_adm: float = 0.0,
    queue_work_s: float | None = None,
) -> WorkerTelemetry:
    """A prefill worker at PPI ``ppi`` has ``ppi`` x S_TTFT (1 s) of work queued unless
    told otherwise (its queue's deadlines all S_TTFT away), so both prefill ranks agree."""
    free_blocks = round(128 * (1 - dpi_adm))
    work_s = ppi if queue_work_s is None else queue_work_s
    metrics = {"queue_work_s": work_s} if role == "prefill" else {}
    return worker_telemetry(
        worker_id, role, seq=seq, free_blocks=free_blocks, ppi=ppi, dpi_adm=dpi_adm,
        metrics=metrics,
    )  # fmt: skip


P = [worker_record("p1", "prefill"), worker_record("p2", "prefill"), worker_record("p3", "prefill")]
D = [worker_record("d1", "decode"), worker_record("d2", "decode")]


def policy(**kw: float) -> PressurePolicy:
    return PressurePolicy(cfg=PressureConfig(stale_after_s=1.0, ttft_s=1.0, profile=PROFILE, **kw))


def seed(pol: PressurePolicy, now: float = T0, seq: int = 0) -> None:
    for wid, ppi in (("p1", 0.0), ("p2", 0.25), ("p3", 0.5)):
        pol.observe(telemetry(wid, "prefill", seq=seq, ppi=ppi), now_mono_s=now)
    for wid, adm in (("d1", 0.0), ("d2", 0.25)):
        pol.observe(telemetry(wid, "decode", seq=seq, dpi_adm=adm), now_mono_s=now)


def burst(pol: PressurePolicy, n: int, now: float) -> list[tuple[str, str]]:
    return [pol.choose(P, D, prompt_tokens=128, max_tokens=128, now_mono_s=now) for _ in range(n)]


def test_scores_rise_by_the_work_sent() -> None:
    assert prefill_score(0.25, 0.5, 2.0) == 0.5  # + T_pre / S_TTFT
    assert decode_score(0.25, 16, 128) == 0.375  # + reserved blocks / all blocks
    assert decode_score(0.0, 5, 0) == 5.0  # no division by zero


def test_burst_within_one_period_water_fills_by_headroom() -> None:
    pol = policy()
    seed(pol)
    pairs = burst(pol, 10, T0 + 0.001)
    # Each worker is filled until its estimated PPI (0 / 0.25 / 0.5 + 0.125 per request)
    # reaches the others'; ties go to the worker with fewer requests sent since telemetry.
    assert [p for p, _ in pairs] == ["p1", "p1", "p2", "p1", "p2", "p1", "p3", "p2", "p1", "p3"]
    # Decode: estimated DPI_adm 0 / 0.25 + 0.125 per request (16 of 128 blocks).
    assert [d for _, d in pairs] == ["d1", "d1", "d2", "d1", "d2", "d1", "d2", "d1", "d2", "d1"]
    # The old ranking (telemetry only) sent the whole burst to p1 and d1.
    assert {p for p, _ in pairs} == {"p1", "p2", "p3"}


def test_decode_horizon_and_slots_come_from_each_workers_record() -> None:
    # d2 reserves 1024 decode tokens per request (its --decode-reserve-tokens), d1 256:
    # with 128-token prompts and max_tokens 1024, a pairing costs d1 24 of 128 blocks
    # (+0.1875) and d2 72 (+0.5625), so d1 takes the larger share of a burst.
    wide = [
        worker_record("d1", "decode"),
        worker_record("d2", "decode", decode_reserve_tokens=1024),
    ]
    pol = policy()
    seed(pol)
    pol.observe(telemetry("d2", "decode", seq=1, dpi_adm=0.0), now_mono_s=T0)
    got = [
        pol.choose(P, wide, prompt_tokens=128, max_tokens=1024, now_mono_s=T0)[1] for _ in range(8)
    ]
    assert got == ["d1", "d2", "d1", "d1", "d2", "d1", "d1", "d1"]
    # d1 admits 2 requests at a time (its --max-num-seqs), d2 64: d1's slots fill at once.
    narrow = [worker_record("d1", "decode", max_num_seqs=2), worker_record("d2", "decode")]
    pol = policy()
    seed(pol)
    pol.observe(telemetry("d2", "decode", seq=1, dpi_adm=0.0), now_mono_s=T0)
    got = [
        pol.choose(P, narrow, prompt_tokens=16, max_tokens=16, now_mono_s=T0)[1] for _ in range(10)
    ]
    assert got == ["d1"] + ["d2"] * 9


def test_request_size_matters() -> None:
    pol = policy()
    seed(pol)
    # A 512-token prompt (+0.5) on p1 puts it above p2 (0.25): the next goes to p2.
    assert pol.choose(P, D, prompt_tokens=512, max_tokens=128, now_mono_s=T0)[0] == "p1"
    assert pol.choose(P, D, prompt_tokens=128, max_tokens=128, now_mono_s=T0)[0] == "p2"
    # Without sizes the configured defaults count (1024 tokens: +1.0).
    pol2 = policy()
    seed(pol2)
    assert [pol2.choose(P, D, now_mono_s=T0)[0] for _ in range(3)] == ["p1", "p2", "p3"]


def test_later_telemetry_resets_the_local_estimate() -> None:
    pol = policy()
    seed(pol)
    assert [p for p, _ in burst(pol, 4, T0 + 0.001)] == ["p1", "p1", "p2", "p1"]
    # p1 reports again (it has seen those 3 requests): its PPI is what it says, 0.125,
    # and the sends before the message no longer count on top of it.
    pol.observe(telemetry("p1", "prefill", seq=1, ppi=0.125), now_mono_s=T0 + 0.020)
    # p1 0.125 < p2 0.375 (0.25 + one sent) < p3 0.5
    assert [p for p, _ in burst(pol, 3, T0 + 0.021)] == ["p1", "p1", "p2"]


def test_telemetry_arriving_right_after_a_send_keeps_counting_it() -> None:
    pol = policy(telemetry_lag_s=0.005)
    seed(pol)
    assert pol.choose(P, D, prompt_tokens=1024, max_tokens=128, now_mono_s=T0 + 0.010)[0] == "p1"
    # Received 3 ms after the send: it may predate the request, so p1 stays at 0 + 1.0.
    pol.observe(telemetry("p1", "prefill", seq=1, ppi=0.0), now_mono_s=T0 + 0.013)
    assert pol.choose(P, D, prompt_tokens=128, max_tokens=128, now_mono_s=T0 + 0.014)[0] == "p2"
    # Received 6 ms after it: it reflects the request (its PPI says so); no double count.
    pol.observe(telemetry("p1", "prefill", seq=2, ppi=0.125), now_mono_s=T0 + 0.016)
    assert pol.choose(P, D, prompt_tokens=128, max_tokens=128, now_mono_s=T0 + 0.017)[0] == "p1"


def test_out_of_order_telemetry_is_ignored() -> None:
    pol = policy()
    seed(pol, seq=5)
    pol.observe(telemetry("p1", "prefill", seq=4, ppi=9.0), now_mono_s=T0 + 0.01)
    assert pol.choose(P, D, prompt_tokens=128, max_tokens=128, now_mono_s=T0 + 0.02)[0] == "p1"
    # A restarted worker (new epoch) starts again at seq 0 and is believed.
    restarted = dataclasses.replace(telemetry("p1", "prefill", seq=0, ppi=9.0), epoch=2)
    pol.observe(restarted, now_mono_s=T0 + 0.03)
    assert pol.choose(P, D, prompt_tokens=128, max_tokens=128, now_mono_s=T0 + 0.04)[0] == "p2"


def test_stale_telemetry_falls_back_to_round_robin() -> None:
    pol = policy()
    seed(pol)
    later = T0 + 1.5  # every message is older than stale_after_s = 1 s
    pairs = burst(pol, 6, later)
    assert [p for p, _ in pairs] == ["p1", "p2", "p3"] * 2
    assert [d for _, d in pairs] == ["d1", "d2"] * 3
    # One fresh worker ranks first; the stale ones come after it whatever they reported.
    pol.observe(telemetry("p3", "prefill", seq=1, ppi=3.0), now_mono_s=later)
    assert [p for p, _ in burst(pol, 3, later + 0.01)] == ["p3"] * 3


def test_forget_drops_telemetry_and_ledger() -> None:
    pol = policy()
    seed(pol)
    burst(pol, 2, T0)
    pol.forget("p1")
    # p1 has no telemetry now: it ranks after the fresh p2, p3.
    assert [p for p, _ in burst(pol, 2, T0)] == ["p2", "p2"]


def test_config_validation_and_make_policy() -> None:
    with pytest.raises(ValueError):
        PressureConfig(ttft_s=0.0)
    with pytest.raises(ValueError):
        PressureConfig(stale_after_s=0.1, telemetry_lag_s=0.2)
    with pytest.raises(ValueError):
        PressureConfig(default_max_tokens=0)
    pol = make_policy("pressure", 2.0, ttft_s=3.0)
    assert isinstance(pol, PressurePolicy)
    assert (pol.stale_after_s, pol.cfg.ttft_s) == (2.0, 3.0)
    assert pol.cfg.prefill_work_s(1000) > 0  # the shipped default profile
    rr = make_policy("round_robin")
    assert isinstance(rr, RoundRobinPolicy)
    assert rr.choose(P, D, prompt_tokens=5) == ("p1", "d1")  # accepts (ignores) the sizes
    with pytest.raises(ValueError):
        make_policy("random")


def test_decode_pairings_count_until_settled_not_until_telemetry() -> None:
    pol = policy()
    seed(pol)
    ids = [f"r{i}" for i in range(3)]
    got = [
        pol.choose(P, D, prompt_tokens=128, max_tokens=128, request_id=r, now_mono_s=T0)[1]
        for r in ids
    ]
    assert got == ["d1", "d1", "d2"]  # d1 0 → 0.125 → 0.25 ties d2 0.25 (fewer sent)
    # d1's telemetry cannot show requests still queued at their prefill workers: it says 0.
    pol.observe(telemetry("d1", "decode", seq=1, dpi_adm=0.0), now_mono_s=T0 + 0.1)
    nxt = pol.choose(P, D, prompt_tokens=128, max_tokens=128, request_id="r3", now_mono_s=T0 + 0.1)
    assert nxt[1] == "d1"  # d1 0.25 (two unsettled) vs d2 0.375 (0.25 + one unsettled)
    pol.settle("r0")
    pol.settle("r1")
    pol.settle("r3")
    pol.settle("unknown")  # ignored
    # d1 has nothing unsettled (0.0) against d2's 0.375: the next two go to d1.
    later = [
        pol.choose(
            P, D, prompt_tokens=128, max_tokens=128, request_id=f"s{i}", now_mono_s=T0 + 0.1
        )[1]
        for i in range(2)
    ]
    assert later == ["d1", "d1"]


def test_unsettled_pairings_expire_and_retries_replace_them() -> None:
    pol = policy(pending_expiry_s=5.0)
    seed(pol)
    assert (
        pol.choose(P, D, prompt_tokens=128, max_tokens=128, request_id="a", now_mono_s=T0)[1]
        == "d1"
    )
    # The same id again (the dispatcher's retry) moves the pairing instead of adding one.
    pair = pol.choose(
        P, D, frozenset({"d1"}), prompt_tokens=128, max_tokens=128, request_id="a", now_mono_s=T0
    )
    assert pair[1] == "d2"
    assert pol.choose(P, D, prompt_tokens=128, max_tokens=128, now_mono_s=T0)[1] == "d1"
    # Fresh telemetry 6 s later: "a" (never settled) has expired, d2 ranks on what it says.
    seed(pol, now=T0 + 6.0, seq=1)
    assert pol.choose(P, D, prompt_tokens=128, max_tokens=128, now_mono_s=T0 + 6.0)[1] == "d1"
    assert pol._pending == {}  # the bound on the policy's memory


def test_a_withdrawn_choice_counts_nowhere() -> None:
    """The router sheds a request after its pair is chosen (dispatch.py ``submit``'s
    ``admit``): withdrawn, the policy chooses as if it had never been chosen."""
    pol, ref = policy(), policy()
    seed(pol)
    seed(ref)
    kw: dict[str, Any] = {"prompt_tokens": 512, "max_tokens": 128, "now_mono_s": T0}
    assert pol.choose(P, D, request_id="shed", **kw) == ("p1", "d1")
    pol.withdraw("shed")
    pol.withdraw("shed")  # twice: nothing left to undo
    # Unwithdrawn, p1 (0 + 0.5) and d1 (0 + 40/128) would now rank behind p2 and d2.
    for i in range(4):
        rid = f"r{i}"
        assert pol.choose(P, D, request_id=rid, **kw) == ref.choose(P, D, request_id=rid, **kw)
    pol.withdraw("r0")  # not the latest choice: ignored
    assert pol.choose(P, D, request_id="r9", **kw) == ref.choose(P, D, request_id="r9", **kw)
    assert pol._pending == ref._pending  # the decode pairings counted: the same ones
    work_s = {w: s.work_s for w, s in pol._sent.items()}
    assert work_s == {w: s.work_s for w, s in ref._sent.items()}


def test_round_robin_withdrawn_keeps_the_prefill_turn_and_gives_back_the_decode_turn() -> None:
    rr = RoundRobinPolicy()
    assert rr.choose(P, D, request_id="shed") == ("p1", "d1")
    rr.withdraw("shed")  # p1's turn is spent (or a long queue would shed all after it) ...
    assert rr.choose(P, D, request_id="a") == ("p2", "d1")  # ... d1 was never used
    rr.withdraw("shed")  # not the latest choice: ignored
    assert rr.choose(P, D, request_id="b") == ("p3", "d2")


@pytest.mark.parametrize("fresh_prefill", [False, True], ids=["all-stale", "decode-stale"])
def test_a_withdrawn_fallback_choice_rewinds_the_round_robin_as_round_robin_does(
    fresh_prefill: bool,
) -> None:
    """Without fresh telemetry the pressure policy picks by round robin; a withdrawn choice
    made that way gives its decode turn back exactly as RoundRobinPolicy.withdraw does
    (the prefill turn stays taken), so the picks after it are round robin's. With fresh
    prefill telemetry only the decode pick is a fallback one, and only it is rewound."""
    pol, rr = policy(), RoundRobinPolicy()
    if fresh_prefill:
        for wid, ppi in (("p1", 0.0), ("p2", 0.25), ("p3", 0.5)):
            pol.observe(telemetry(wid, "prefill", ppi=ppi), now_mono_s=T0)
    kw: dict[str, Any] = {"prompt_tokens": 128, "max_tokens": 128}

    def decode_picks(sequence: list[tuple[str, bool]]) -> tuple[list[str], list[str]]:
        got, want = [], []
        for rid, shed in sequence:
            got.append(pol.choose(P, D, request_id=rid, now_mono_s=T0 + 0.001, **kw)[1])
            want.append(rr.choose(P, D, request_id=rid)[1])
            if shed:
                pol.withdraw(rid)
                rr.withdraw(rid)
        return got, want

    got, want = decode_picks([("shed", True), ("a", False), ("b", True), ("c", False)])
    assert got == want == ["d1", "d1", "d2", "d2"]
    if not fresh_prefill:  # every pick a fallback one: the whole pair is round robin's
        assert pol.choose(P, D, request_id="x", **kw) == rr.choose(P, D, request_id="x")
    pol.withdraw("a")  # not the latest choice: ignored, as by round robin
    rr.withdraw("a")
    got, want = decode_picks([("y", False)])
    assert got == want


def test_prefill_ranks_by_the_wait_the_door_predicts_before_the_ppi() -> None:
    """p1 holds one request near its deadline (PPI 0.9, 0.25 s queued); p2 holds fresh long
    work (PPI 0.5, 0.75 s queued). A newcomer waits less on p1, so p1 is picked although its
    PPI is higher: the door (predicted TTFT = queued work + own T_pre, multiple 1 x S_TTFT)
    admits it there and would shed it on p2. Then the work sent to p1 counts: the second
    newcomer's wait is 0.25 + 0.5 on p1, 0.75 on p2 — a tie the PPI estimate breaks."""
    from shared.policy.admission import SheddingConfig, predicted_ttft_s, should_shed

    pol = policy()
    pol.observe(telemetry("p1", "prefill", ppi=0.9, queue_work_s=0.25), now_mono_s=T0)
    pol.observe(telemetry("p2", "prefill", ppi=0.5, queue_work_s=0.75), now_mono_s=T0)
    two = P[:2]
    picks = [pol.choose(two, D, prompt_tokens=512, now_mono_s=T0)[0] for _ in range(2)]
    # Second pick: p1's estimated PPI is 0.9 + 0.5, p2's 0.5: p2.
    assert picks == ["p1", "p2"]
    door = SheddingConfig(ttft_multiple=1.0)
    assert PROFILE.prefill_time_s(512) == 0.5
    assert not should_shed(predicted_ttft_s(0.25, 512, PROFILE), 1.0, door)
    assert should_shed(predicted_ttft_s(0.75, 512, PROFILE), 1.0, door)
