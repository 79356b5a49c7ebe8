"""FluidRole (ADAPTIVE) at a stage edge into decode-heavy traffic, at overload: requests
waiting on every decode worker read as saturated decode admission though the smoothed DPI̅_adm
still lags (``waiting_saturates_adm``), and a P→D follow-up while decode binds does not wait
``settle_s`` (``p2d_follow_binds``). PAPER has neither. Pure functions, no processes."""

from __future__ import annotations

import dataclasses

import pytest

from services.bench.shift_analysis import recommendation
from shared.policy.cluster_view import ClusterSnapshot, WorkerView
from shared.policy.config import PAPER, PolicyConfig
from shared.policy.decision import Decision
from shared.policy.errors import PolicyConfigError
from shared.policy.fluidrole import RolePolicy
from shared.policy.fluidrole_rules import NONE, P2D
from shared.policy.roles import DECODE, DRAIN, PREFILL, SWITCH
from tests.support.role_views import SLOTS, busy_prefill, waiting_decode


def cluster(
    n_p: int, waiting: tuple[int, ...], adm: float = 1.0, moving: str | None = None
) -> ClusterSnapshot:
    """``n_p`` busy prefill workers over their TTFT (PPI 1.4) and one decode worker per
    entry of ``waiting``, DPI_load 0.97; with requests waiting every slot is taken, else 40
    (``adm``: the DPI_adm they report). ``moving`` = DRAIN | SWITCH adds worker "pm", a
    prefill worker on its way to decode."""
    prefill = busy_prefill(n_p, 1.4)
    decode = waiting_decode(waiting, load=0.97, adm=adm, active=SLOTS if min(waiting) else 40)
    if moving == DRAIN:
        prefill += (WorkerView("pm", PREFILL, state=DRAIN, prefill_busy_frac=1.0),)
    elif moving == SWITCH:
        decode += (WorkerView("pm", DECODE, state=SWITCH, max_decode_requests=SLOTS),)
    return ClusterSnapshot((*prefill, *decode))


def test_requests_waiting_on_every_decode_worker_read_as_saturated_admission() -> None:
    # 7P1D as a conversation stage follows a code stage: the one decode worker had room for
    # 4 intervals, then its slots fill and 80 requests wait. DPI̅_adm is the median of the
    # window (0.1 still); the waiting requests say the slots are full now.
    def last(cfg: PolicyConfig, waiting_now: int) -> Decision:
        policy = RolePolicy(cfg)
        for t in range(4):
            assert policy.decide(cluster(7, (0,), adm=0.1), float(t)).action == NONE
        return policy.decide(cluster(7, (waiting_now,)), 4.0)

    cfg = PolicyConfig()
    assert cfg.waiting_saturates_adm and cfg.blocked_waiting_batches == 0.5
    d = last(cfg, 80)
    assert d.dpi_adm_bar == pytest.approx(0.1)
    assert (d.action, d.reason) == (P2D, "decode_admission_blocks_prefill")
    assert d.worker_ids == ("p0",)  # one: prefill is busy
    # The published inputs give the same recommendation (bench shift re-derives it).
    assert recommendation(d.inputs(8), cfg) == P2D
    # Under half a batch waiting, or the flag off, the lagging median decides: no move.
    for case, waiting in ((cfg, 20), (dataclasses.replace(cfg, waiting_saturates_adm=False), 80)):
        d = last(case, waiting)
        assert (d.action, d.reason) == (NONE, "both_phases_pressured")
    d = last(dataclasses.replace(cfg, rules=PAPER), 80)
    assert (d.action, d.reason) == (NONE, "both_phases_pressured")


def moves(cfg: PolicyConfig, after: ClusterSnapshot) -> list[float]:
    """Times of the P→D moves: one at t = 0 (7P1D, decode binds), the mover in transit at
    t = 1 (Drain) and 2 (Switch), then ``after`` from t = 3 to 12."""
    policy = RolePolicy(cfg)
    first = policy.decide(cluster(7, (80,)), 0.0)
    assert (first.action, first.worker_ids) == (P2D, ("p0",))
    for t, moving in ((1.0, DRAIN), (2.0, SWITCH)):
        assert policy.decide(cluster(6, (80,), moving=moving), t).reason == "switch_in_progress"
    return [float(t) for t in range(3, 13) if policy.decide(after, float(t)).switches]


def test_a_move_to_decode_while_decode_binds_is_followed_without_settling() -> None:
    cfg = PolicyConfig()
    assert cfg.p2d_follow_binds and cfg.settle_s == 6.0
    # 6P2D, both decode workers full with 40 waiting each: 208 requests for 128 slots.
    binds = cluster(6, (40, 40))
    assert moves(cfg, binds)[:1] == [3.0]  # as soon as the mover is Active
    # Off: the follow-up counts its persistence while settling and fires as it ends.
    assert moves(dataclasses.replace(cfg, p2d_follow_binds=False), binds)[:1] == [8.0]
    # Decode short of admission headroom but not binding (40 of 64 slots taken on each,
    # prefill idle: eq. 23): the follow-up settles whatever the flag.
    idle = ClusterSnapshot(
        (
            *(WorkerView(f"p{i}", PREFILL, ppi_p95=0.1, prefill_busy_frac=0.2) for i in range(6)),
            *(
                WorkerView(
                    f"d{i}",
                    DECODE,
                    dpi_load=0.5,
                    dpi_adm=0.5,
                    active_decode_requests=40,
                    max_decode_requests=SLOTS,
                )
                for i in range(2)
            ),
        )
    )
    assert moves(cfg, idle)[:1] == [8.0]


def test_the_stage_edge_flags_must_be_bools() -> None:
    for name in ("p2d_follow_binds", "waiting_saturates_adm"):
        with pytest.raises(PolicyConfigError, match=name):
            PolicyConfig(**{name: 1})
        doc = PolicyConfig(**{name: False}).to_dict()
        assert PolicyConfig.from_dict(doc).to_dict()[name] is False
