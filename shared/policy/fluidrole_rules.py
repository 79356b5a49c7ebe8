"""FluidRole's recommendation (shared/policy/fluidrole.py rule 5): eq. 22–23 and, under
ADAPTIVE rules, the extensions documented there. Pure."""

from __future__ import annotations

from shared.policy.config import PAPER, PolicyConfig
from shared.policy.fluidrole_sizing import D2P, P2D, adm_guard

NONE = "none"


def recommend(
    ppi_bar: float,
    dpi_load_bar: float,
    dpi_adm_bar: float,
    cfg: PolicyConfig,
    *,
    adm_guard_value: float | None = None,
    ppi_now: float | None = None,
    decode_waiting_batches: float | None = None,
) -> tuple[str, str]:
    """Eq. 22–23 plus the both-pressured rule: (recommendation, reason). ADAPTIVE's D→P
    admission guard compares ``adm_guard_value`` (default: ``dpi_adm_bar``). ADAPTIVE's
    ``decode_admission_blocks_prefill`` also needs ``decode_waiting_batches`` (the least
    decode backlog waiting for admission over the Active decode workers, in batches; None =
    not known: not checked) at least ``cfg.blocked_waiting_batches``, else the answer is
    ``both_phases_short`` (no move). ADAPTIVE only:
    where the windowed PPI̅ gives no recommendation, the rules are read again with
    ``ppi_now`` (PPI̅ as it is now, the prefill workers' latest PPI; None = not known) and
    a P→D answer is taken: eq. 20's window keeps a drained queue's peak for window_s, which
    reads as ``both_phases_pressured`` / ``prefill_not_idle`` while the decode side it
    starved sheds. A move to prefill still needs the windowed value (spikes are filtered
    there)."""
    if cfg.rules == PAPER:  # the paper, literally
        if ppi_bar > cfg.ppi_high and dpi_load_bar < cfg.dpi_load_high:
            return D2P, "eq22_prefill_pressure"
        if dpi_adm_bar > cfg.dpi_adm_high and ppi_bar < cfg.ppi_low:
            return P2D, "eq23_decode_admission_pressure"
        if ppi_bar > cfg.ppi_high:
            return NONE, "both_phases_pressured"
        if dpi_adm_bar > cfg.dpi_adm_high:
            return NONE, "prefill_not_idle"
        return NONE, "balanced"
    guard_adm = dpi_adm_bar if adm_guard_value is None else adm_guard_value
    rec = _adaptive(ppi_bar, dpi_load_bar, dpi_adm_bar, guard_adm, decode_waiting_batches, cfg)
    if rec[0] == NONE and ppi_now is not None and ppi_now < ppi_bar:
        rec_now = _adaptive(
            ppi_now, dpi_load_bar, dpi_adm_bar, guard_adm, decode_waiting_batches, cfg
        )
        if rec_now[0] == P2D:
            return rec_now
    return rec


def _adaptive(
    ppi_bar: float,
    dpi_load_bar: float,
    dpi_adm_bar: float,
    guard_adm: float,
    waiting_batches: float | None,
    cfg: PolicyConfig,
) -> tuple[str, str]:
    """ADAPTIVE's rules on one reading of PPI̅ (see ``recommend``)."""
    # Extension: the decode batch nears its TPOT-safe size while admission may still have
    # room (DPI_adm only rises once the slots are full, after TPOT is already missed).
    load_pressed = 0 < cfg.p2d_load_trigger < dpi_load_bar
    if ppi_bar > cfg.ppi_high and dpi_load_bar < cfg.dpi_load_high and guard_adm < adm_guard(cfg):
        # Eq. 22, unless the decode pool is short of admission headroom (extension): taking
        # a decode worker away then only deepens the backpressure that built the backlog.
        # The bound sits below dpi_adm_blocking (hysteresis) so P->D and D->P cannot chase
        # each other around one threshold.
        return D2P, "eq22_prefill_pressure"
    if dpi_adm_bar > cfg.dpi_adm_high and ppi_bar < cfg.ppi_low:
        return P2D, "eq23_decode_admission_pressure"
    if load_pressed and ppi_bar < cfg.ppi_low:
        return P2D, "decode_load_pressure"
    if ppi_bar > cfg.ppi_high:
        limit = cfg.blocked_waiting_batches
        waiting = waiting_batches if limit > 0 else None  # None: not known, or the rule off
        # Requests waiting on every decode worker mean its slots are full now; the smoothed
        # DPI̅_adm lags that by half a window (config.py, waiting_saturates_adm).
        waits = cfg.waiting_saturates_adm and waiting is not None and waiting >= limit
        if dpi_adm_bar >= cfg.dpi_adm_blocking or waits:
            # Extension (the paper's §IV-B ambiguity): a decode pool that has (nearly) no
            # admission headroom left refuses the prefill queue's head, so the prefill
            # backlog is decode backpressure, not prefill overload — only more decode
            # capacity can drain it. Unless decode keeps up: its slots are full but few
            # requests wait for one, so the prefill queue is prefill's own and both phases
            # are short (config.py, blocked_waiting_batches).
            if waiting is not None and waiting < limit:
                return NONE, "both_phases_short"
            return P2D, "decode_admission_blocks_prefill"
        return NONE, "both_phases_pressured"
    if dpi_adm_bar > cfg.dpi_adm_high or load_pressed:
        return NONE, "prefill_not_idle"
    return NONE, "balanced"
