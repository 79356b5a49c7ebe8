"""The analysis of a ``fluidpd bench shift`` run: per switch its persistence run, decision
lag and drain; per phase the switches taken and when eq. 22 / 23 first held, recomputed
from each decision's own published inputs. Pure: reads an Observer's record.
"""

from __future__ import annotations

import itertools
from typing import Any

from services.bench.shift_observer import Observer
from shared.policy.config import PolicyConfig
from shared.policy.fluidrole import D2P, P2D, recommend
from shared.policy.roles import ACTIVE, DRAIN, SWITCH


def recommendation(inputs: dict[str, float], cfg: PolicyConfig) -> str:
    """What eq. 22/23 (with the product's extensions) recommend on a decision's published
    inputs: D2P, P2D or "none". Gates (cooldown, persistence, one at a time) not applied."""
    return recommend(
        inputs["ppi_bar"],
        inputs["dpi_load_bar"],
        inputs["dpi_adm_bar"],
        cfg,
        adm_guard_value=inputs.get("dpi_adm_guard"),
        ppi_now=inputs.get("ppi_now"),
        decode_waiting_batches=inputs.get("decode_waiting_batches"),
    )[0]


def _switch_row(obs: Observer, k: int, cfg: PolicyConfig) -> dict[str, Any]:
    """One switch decision: its persistence run, its worker's drain and return to Active.

    ``onset`` is the first decision of the run of ``persisting_*`` decisions right before
    the switch (the first interval the policy counted); ``held_since`` the first of the
    consecutive decisions whose inputs satisfied the equation (it can be earlier when a
    cooldown was running) — the recommendation recomputed from each decision's inputs. Times are this process's monotonic clock.
    """
    decisions = obs.decisions
    t_dec, d = decisions[k]
    run = 0
    while k - run - 1 >= 0 and decisions[k - run - 1][1].reason.startswith("persisting_"):
        run += 1
    since = k
    while since - 1 >= 0 and recommendation(decisions[since - 1][1].inputs, cfg) == d.action:
        since -= 1
    mine = [(t, e) for t, e in obs.events if e.publisher_id == d.target_worker_id and t >= t_dec]
    drain_t = next((t for t, e in mine if e.to_state == DRAIN), None)
    back = next(((t, e) for t, e in mine if e.to_state == ACTIVE), None)
    active_t = back[0] if back else None
    return {
        "action": d.action,
        "worker_id": d.target_worker_id,
        "t_onset": decisions[k - run][0],
        "t_held_since": decisions[since][0],
        "t_decided": t_dec,
        "t_drain_start": drain_t,
        "t_active": active_t,
        "intervals_counted": run + 1,
        "completed": bool(back and back[1].from_state == SWITCH),
        "decision_lag_s": round(t_dec - decisions[k - run][0], 3),
        "drain_s": round(active_t - drain_t, 3) if active_t and drain_t else None,
        "onset_to_active_s": round(active_t - decisions[k - run][0], 3) if active_t else None,
    }


def analyse(
    obs: Observer, t0: float, bounds: list[tuple[str, float, float]], cfg: PolicyConfig
) -> dict[str, Any]:
    """Switches and per-phase figures; every ``*_s`` time is relative to the load start."""

    def phase_of(t: float) -> str:
        return next((lb for lb, a, b in bounds if a <= t - t0 < b), "after")

    decisions = obs.decisions
    switches = []
    for k, (_, d) in enumerate(decisions):
        if d.action in (D2P, P2D):
            row = _switch_row(obs, k, cfg)
            row["phase"] = phase_of(row["t_decided"])
            for key in [x for x in row if x.startswith("t_")]:
                t = row.pop(key)
                row[key[2:] + "_s"] = None if t is None else round(t - t0, 3)
            switches.append(row)
    phases = {}
    for label, start, end in bounds:
        inside = [d for t, d in decisions if start <= t - t0 < end]
        mine = [s for s in switches if s["phase"] == label]
        first = {
            action: next(
                (
                    round(t - t0, 3)
                    for t, d in decisions
                    if start <= t - t0 < end and recommendation(d.inputs, cfg) == action
                ),
                None,
            )
            for action in (D2P, P2D)
        }
        t_ppi = next(
            (t for t, v in obs.prefill_ppi if start <= t - t0 < end and v > cfg.ppi_high), None
        )
        phases[label] = {
            "start_s": start,
            "end_s": end,
            "decisions": len(inside),
            "switches_d2p": sum(s["action"] == D2P for s in mine),
            "switches_p2d": sum(s["action"] == P2D for s in mine),
            # First decision whose inputs recommend a switch (eq. 22 / eq. 23), gated or not.
            "first_d2p_signal_s": first[D2P],
            "first_p2d_signal_s": first[P2D],
            # First telemetry (any prefill worker, instantaneous) with PPI > PPI_high.
            "first_ppi_over_high_s": None if t_ppi is None else round(t_ppi - t0, 3),
            "reasons": _count(d.reason for d in inside),
            **{
                f"max_{k}": round(max((d.inputs[k] for d in inside), default=0.0), 3)
                for k in ("ppi_bar", "dpi_load_bar", "dpi_adm_bar")
            },
            "layout_end": [int(inside[-1].inputs[k]) for k in _LAYOUT] if inside else None,
        }
    seqs = [d.seq for _, d in decisions]
    return {
        "switches": switches,
        "phases": phases,
        "decisions_total": len(decisions),
        "decision_seq_gaps": [b - a for a, b in itertools.pairwise(seqs) if b - a != 1],
        "decision_span_s": round(decisions[-1][0] - decisions[0][0], 3) if decisions else 0.0,
        "cancelled_switches": sum(
            1 for _, e in obs.events if e.from_state == DRAIN and e.to_state == ACTIVE
        ),
        "timeline": [
            [round(t - t0, 3), d.action, d.reason, *(round(d.inputs[k], 3) for k in _SIGNALS)]
            for t, d in decisions
        ],
    }


_LAYOUT = ("active_prefill", "active_decode")
_SIGNALS = ("ppi_bar", "dpi_load_bar", "dpi_adm_bar", *_LAYOUT)


def _count(reasons: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for reason in reasons:
        key = "persisting" if reason.startswith("persisting_") else reason
        out[key] = out.get(key, 0) + 1
    return out
