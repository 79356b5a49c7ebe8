"""PolicyConfig: every SLO and threshold of FluidToken and FluidRole in one place, per model.

Defaults follow the paper where it gives a value: η = 1.25, PPI_low = 0.6, PPI_high = 1.0,
DPI_load^high = 0.6, DPI_adm^high = 0.2 (§V-F); TTFT 2000 ms / TPOT 100 ms (Llama-3.1-8B,
§V-A). N_persist, T_cooldown, the window and ε are not given in the paper; ours are chosen
for a 1 s decision interval and documented on each field.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from shared.policy.errors import PolicyConfigError

# FluidRole rule sets (PolicyConfig.rules). PAPER: eq. 22–23 literally, one worker per
# decision, a fixed cooldown. ADAPTIVE (default): sized moves and settle-time hysteresis
# (shared/policy/fluidrole_sizing.py) plus the DPI_adm extensions (fluidrole.recommend).
PAPER = "paper"
ADAPTIVE = "adaptive"
RULE_SETS = (ADAPTIVE, PAPER)


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Immutable; validated on construction (raises PolicyConfigError)."""

    model: str = ""
    # SLOs.
    ttft_ms: float = 2000.0  # S_TTFT (eq. 1)
    tpot_ms: float = 100.0  # S_TPOT (eq. 14)
    # FluidToken.
    eta: float = 1.25  # η, slack multiplier (eq. 15–16)
    ppi_epsilon_ms: float = 1.0  # ε of eq. 4/11: floor of the remaining-budget denominator
    budget_stale_ms: float = 100.0  # a steal budget older than this counts as 0 (≈5 publishes)
    # L_ctx assumed when inverting T_sfx for the advertised budget (eq. 16): a typical prefix.
    # 0 (the paper's one-argument T_sfx) over-states the allowance for any real prefix; the
    # admission re-check and the per-iteration chunk use the actual prefix instead.
    budget_context_tokens: int = 2048
    max_steal_ratio: float = 1.0  # cap on β_i; 1.0 = the paper (whole prompt may be stolen)
    # FluidRole (eq. 20–23).
    rules: str = ADAPTIVE  # ADAPTIVE | PAPER, see RULE_SETS above
    ppi_low: float = 0.6
    ppi_high: float = 1.0
    dpi_load_high: float = 0.6  # also the FluidToken eligibility bound of eq. 12/17
    dpi_adm_high: float = 0.2
    # Not in the paper: when PPI is high but the decode pool's admission is this full, the
    # prefill backlog is decode backpressure and FluidRole adds decode capacity (P->D).
    dpi_adm_blocking: float = 0.9
    n_persist: int = 3  # consecutive agreeing decision intervals before a switch
    cooldown_s: float = 20.0  # T_cooldown after a switch (D→P drain can take ~12 s, §V-H)
    # ADAPTIVE only. cooldown_s then guards only a move *against* the last one; a further
    # move the same way waits settle_s after every switched worker is Active again (the
    # time its effect needs to show in the signals: the PPI p95 window, eq. 20, plus a
    # margin). A decision moves up to max_move_workers workers at once (sizing module).
    settle_s: float = 6.0
    # ADAPTIVE only: a P->D follow-up counts its n_persist intervals during settle_s, so it
    # fires as the settle ends. The return to decode at a stage edge takes several moves
    # and each used to cost settle_s + n_persist intervals (16 workers, 43 s stages: 4 of 10
    # cells lost the goal on that lag). A D->P follow-up still counts after the settle:
    # moving sooner overshoots at short stages (1,500-request staged set: -5.5 pp).
    p2d_persist_while_settling: bool = True
    # ADAPTIVE only: a D->P move its bounds cut short (the decode side's load, admission or
    # backlog bound let fewer workers go than PPI's gap asks) is followed without settle_s:
    # the settle lets a move's effect show before judging it, but the gap left was known at
    # the decision, and what holds it back is the decode backlog draining, which the bounds
    # re-check at every decision. Persistence still counts (n_persist intervals). At a
    # stage edge from conversation to code the first move was bound by the conversation
    # backlog and the rest waited a settle while that backlog drained within 3 s
    # (1,500-request azure-staged, 35 rps: 4P4D -> 5P3D, 7P1D 8 s later in a 14 s stage;
    # docs/results.md Session 18).
    d2p_follow_shortfall: bool = True
    # ADAPTIVE only: a P->D follow-up while decode binds (its backlog, or where the decode
    # flow settles, exceeds every decode slot) is made without settle_s, once the last
    # mover is Active (n_persist_binds intervals still count). A P->D move while decode
    # binds and prefill is busy is one worker (sizing module: the backlog's gap overshot),
    # so a conversation stage after a code stage at overload went 7P1D -> 6P2D -> 5P3D
    # one settle apart, 11 s of a 23 s stage, while the router shed on the decode backlog
    # (staged 130, 9,000 requests; docs/results.md Session 20). The binds test is re-made
    # at every decision, and both_phases_short stops the moves once decode keeps up.
    p2d_follow_binds: bool = True
    # ADAPTIVE only: a move *against* the last one waits this long after the last moment a
    # worker was seen in transit (oscillation guard; PAPER waits cooldown_s from the switch).
    # Shorter than cooldown_s because a wrong move must be undone before its cost piles up:
    # a D->P move that starves decode saturates it within seconds (azure-mixed 30 rps: 7P1D
    # at DPI_load 1.0 for 11 s of a 20 s cooldown), while settle_s + n_persist intervals
    # already separate any two moves. 4 s since Session 19 (8 s before): at a stage edge
    # under overload a P->D move made for the last stage's decode backlog held the next
    # stage's D->P move back for 8 s + n_persist while that backlog drained within ~5 s
    # (staged 130, 9,000 requests; every set: 26 -> 22 goal misses, no cell lost;
    # docs/results.md Session 19).
    reverse_wait_s: float = 4.0
    # ADAPTIVE only: the reverse wait of a P->D move while decode binds (its backlog, or
    # where the decode flow settles, exceeds every decode slot), when shorter than
    # reverse_wait_s (it is not at the defaults since reverse_wait_s is 4 s): the router is
    # then shedding on the decode backlog, and each second of waiting sheds a second of
    # arrivals (1,500-request azure-staged at 35 rps: 181 requests in 7 s after a late D->P
    # move, with reverse_wait_s 8 s).
    reverse_wait_binds_s: float = 4.0
    max_move_workers: int = 3
    # ADAPTIVE only (shared/policy/fluidrole_sizing.py). A D->P move must leave the decode
    # side's predicted DPI_load below DPI_load^high minus this margin, and the decode backlog
    # (running + waiting for admission) within decode_fill_target of the remaining decode
    # slots; a P->D move adds at least the workers that backlog needs.
    d2p_load_margin: float = 0.0
    decode_fill_target: float = 0.75
    # ADAPTIVE only: a P->D move must leave the prefill workers' predicted busy fraction
    # (shared/policy/busy.py: Σ busy / (|P| − k)) below this; 0 = no bound.
    p2d_busy_bound: float = 0.85
    # ADAPTIVE only: P->D also when DPI̅_load exceeds this (the decode batch nears its
    # TPOT-safe size; eq. 23 reads DPI̅_adm only, which stays low until the slots are full)
    # and prefill is idle (PPI̅ < PPI_low), sized to bring DPI̅_load back to DPI_load^high;
    # 0 = off. Above DPI_load^high, so D->P's own load bound cannot move the workers back.
    p2d_load_trigger: float = 0.8
    # ADAPTIVE only: FluidRole reads DPI̅_adm as this percentile of its samples over window_s
    # (one per decision; 50 = the median, which ignores one-interval spikes — DPI_adm jumps
    # to 1 whenever the batch slots are full); 0 = the instantaneous value. The D->P guard
    # reads the larger of the two (no decode worker leaves a pool that was just full).
    adm_smoothing_q: float = 50.0
    # ADAPTIVE only: decision intervals "decode admission blocks prefill" must hold. The
    # smoothed DPI̅_adm already needs half the window saturated, so 1 adds no extra delay.
    n_persist_blocked: int = 1
    # ADAPTIVE only: decision intervals a P->D recommendation must hold while decode binds
    # (its backlog, or where the decode flow settles, exceeds every decode slot): the
    # signal is then unambiguous — computed prompts wait for a slot and the router sheds on
    # the decode backlog — and each interval of persistence sheds an interval of arrivals
    # (1,500-request azure-staged, 35 rps: 3 intervals cost 2-4 pp at every stage edge
    # into conversation; docs/results.md Session 18).
    n_persist_binds: int = 1
    # ADAPTIVE only: saturated decode admission is read as blocking prefill (rule 5's
    # decode_admission_blocks_prefill, a P->D move) only while every Active decode worker
    # has at least this many batches (max_num_seqs) of requests waiting for admission —
    # the level at which the router's door sheds on the decode backlog (the shedding
    # config's decode_backlog_batches, 0.5 by default). Below it the slots are full but
    # decode keeps up with what prefill sends, the door sheds on prefill's TTFT and the
    # prefill queue is prefill's own: both phases are short, and a P->D move only shifts
    # the shortage (staged 130: 5P3D -> 4P4D -> 3P5D past the per-window oracle's 5P3D;
    # docs/results.md Session 19). Reason both_phases_short, no move. 0 = off.
    blocked_waiting_batches: float = 0.5
    # ADAPTIVE only: requests waiting for admission on every Active decode worker (at least
    # blocked_waiting_batches batches) read as saturated decode admission in rule 5,
    # whatever the smoothed DPI̅_adm says: a request waits only once the slots are full,
    # while the smoothed value (the median over window_s) lags a stage edge by half a
    # window (staged 130: both_phases_pressured for 2-3 s at 7P1D with 80-170 requests
    # waiting on the one decode worker; docs/results.md Session 20).
    waiting_saturates_adm: bool = True
    # ADAPTIVE only (shared/policy/decode_flow.py): the decode backlog FluidRole sizes moves
    # against is at least the forecast N̄·λ_in/λ_out over this window (Little's law: where
    # the flow entering decode settles), scaled for a D->P move of k by (|P| + k)/|P| (more
    # prefill workers send more requests to decode); 0 = off (the backlog now only).
    decode_flow_window_s: float = 10.0
    window_s: float = 5.0  # observation window of the PPI p95 (eq. 20)
    decision_interval_s: float = 1.0  # how often the controller calls RolePolicy.decide

    def __post_init__(self) -> None:
        for f in fields(self):
            # Each field's type is its annotation (a string: postponed annotations), so a
            # JSON value of the wrong kind is caught here, whatever the field.
            value, kind = getattr(self, f.name), str(f.type)
            if kind == "str":
                if not isinstance(value, str):
                    raise PolicyConfigError(f"policy config: {f.name} must be a string")
            elif kind == "bool":
                if not isinstance(value, bool):
                    raise PolicyConfigError(f"policy config: {f.name} must be true or false")
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise PolicyConfigError(f"policy config: {f.name} must be a number")
            elif not math.isfinite(value):
                raise PolicyConfigError(f"policy config: {f.name} must be finite")
            elif kind == "int" and not isinstance(value, int):
                raise PolicyConfigError(f"policy config: {f.name} must be an int")
        positive = (
            "ttft_ms",
            "tpot_ms",
            "eta",
            "ppi_epsilon_ms",
            "budget_stale_ms",
            "ppi_high",
            "window_s",
            "decision_interval_s",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise PolicyConfigError(f"policy config: {name} must be > 0")
        for name in (
            "ppi_low",
            "dpi_load_high",
            "dpi_adm_high",
            "dpi_adm_blocking",
            "cooldown_s",
            "settle_s",
            "reverse_wait_s",
            "reverse_wait_binds_s",
            "budget_context_tokens",
            "decode_flow_window_s",
            "blocked_waiting_batches",
        ):
            if getattr(self, name) < 0:
                raise PolicyConfigError(f"policy config: {name} must be >= 0")
        if not 0.0 <= self.max_steal_ratio <= 1.0:
            raise PolicyConfigError("policy config: max_steal_ratio must be in [0, 1]")
        if self.ppi_low > self.ppi_high:
            raise PolicyConfigError("policy config: ppi_low must not exceed ppi_high")
        if self.rules not in RULE_SETS:
            raise PolicyConfigError(f"policy config: rules must be one of {list(RULE_SETS)}")
        if self.max_move_workers < 1:
            raise PolicyConfigError("policy config: max_move_workers must be >= 1")
        if self.n_persist < 1:
            raise PolicyConfigError("policy config: n_persist must be >= 1")
        if self.n_persist_blocked < 1:
            raise PolicyConfigError("policy config: n_persist_blocked must be >= 1")
        if self.n_persist_binds < 1:
            raise PolicyConfigError("policy config: n_persist_binds must be >= 1")
        if self.d2p_load_margin < 0:
            raise PolicyConfigError("policy config: d2p_load_margin must be >= 0")
        if self.p2d_load_trigger != 0 and self.p2d_load_trigger <= self.dpi_load_high:
            raise PolicyConfigError(
                "policy config: p2d_load_trigger must be 0 (off) or above dpi_load_high"
            )
        if not 0.0 <= self.p2d_busy_bound <= 1.0:
            raise PolicyConfigError("policy config: p2d_busy_bound must be in [0, 1]")
        if not 0.0 < self.decode_fill_target <= 1.0:
            raise PolicyConfigError("policy config: decode_fill_target must be in (0, 1]")
        if not 0.0 <= self.adm_smoothing_q <= 100.0:
            raise PolicyConfigError("policy config: adm_smoothing_q must be in [0, 100]")

    @property
    def ttft_s(self) -> float:
        return self.ttft_ms / 1000.0

    @property
    def tpot_s(self) -> float:
        return self.tpot_ms / 1000.0

    @property
    def ppi_epsilon_s(self) -> float:
        return self.ppi_epsilon_ms / 1000.0

    @property
    def budget_stale_s(self) -> float:
        return self.budget_stale_ms / 1000.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> PolicyConfig:
        """Build from a JSON object; unknown keys are an error (typos must not pass silently)."""
        if not isinstance(doc, dict):
            raise PolicyConfigError("policy config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise PolicyConfigError(f"policy config: unknown keys {unknown}")
        return cls(**doc)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> PolicyConfig:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PolicyConfigError(f"policy config is not JSON: {exc}") from exc
        return cls.from_dict(doc)

    @classmethod
    def load(cls, path: str | Path) -> PolicyConfig:
        return cls.from_json(Path(path).read_text(encoding="utf-8"))
