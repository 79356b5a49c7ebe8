"""Decode pressure of FluidPD (paper §IV-B3): DPI, TPOT slack, suffix sizes, steal budget,
and the KV a decode worker reserves at admission. The prefill side (PPI, eq. 1–5, 9–11,
19) is prefill_pressure.py.

Pure functions over plain numbers and small dataclasses; every function names the equation
it implements. Times are seconds, sizes are tokens. ``now_s`` is always passed in.

Symbols: S_TPOT — the TPOT SLO; C_d^KV / C_d^active / C_d^reserved — KV capacity / occupied by active decodes / reserved for
admitted requests awaiting transfer or execution; N_d^active — decode batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.policy.config import PolicyConfig
from shared.policy.errors import PolicyConfigError
from shared.policy.predictors import LatencyProfile


def admission_kv_tokens(
    prompt_tokens: int, max_tokens: int, decode_reserve_tokens: int, max_model_len: int
) -> int:
    """KV tokens a decode worker reserves when it admits a request: the prompt plus the
    first ``decode_reserve_tokens`` of the output (longer outputs grow while decoding),
    within the context limit. The one definition: the decode worker reserves this many,
    routers count it against the worker they pair a request with. Pure."""
    return min(prompt_tokens + min(max_tokens, decode_reserve_tokens), max_model_len)


@dataclass(frozen=True, slots=True)
class DecodeLoad:
    """Engine state of one decode worker d (inputs of eq. 6–8, 13–14)."""

    kv_capacity_tokens: int  # C_d^KV
    kv_active_tokens: int  # C_d^active (also the aggregate context C of eq. 13)
    kv_reserved_tokens: int  # C_d^reserved
    active_requests: int  # N_d^active
    # Admission slots: requests admitted (reserved or running) and the worker's cap on them
    # (0 = no cap). Our decode workers refuse admission at either limit, KV or slots.
    admitted_requests: int = 0
    max_requests: int = 0

    def __post_init__(self) -> None:
        # C_KV divides eq. 7–8; a worker without KV capacity cannot be a decode worker.
        if self.kv_capacity_tokens <= 0:
            raise PolicyConfigError("DecodeLoad: kv_capacity_tokens must be > 0")
        if min(self.kv_active_tokens, self.kv_reserved_tokens, self.active_requests) < 0:
            raise PolicyConfigError("DecodeLoad: token and request counts must be >= 0")


@dataclass(frozen=True, slots=True)
class DecodePressure:
    """Everything a decode worker derives from its load and advertises (eq. 6–8, 14, 16, 17)."""

    dpi_load: float
    dpi_adm: float
    kv_alloc_tokens: int
    n_tpot: int
    tpot_slack_s: float
    max_suffix_tokens: float
    steal_budget_tokens: float


def kv_alloc_tokens(load: DecodeLoad) -> int:
    """Eq. 6: C_d^alloc = C_d^KV − C_d^active − C_d^reserved (may be negative if over-committed)."""
    return load.kv_capacity_tokens - load.kv_active_tokens - load.kv_reserved_tokens


def n_tpot(
    load: DecodeLoad, profile: LatencyProfile, cfg: PolicyConfig, max_batch: int | None = None
) -> int:
    """N_d^TPOT of eq. 7 at this worker's mean context per sequence c̄ = C_active / N_active
    (c̄ = 0 for an idle worker, where the ratio in eq. 7 is 0 anyway)."""
    mean_ctx = load.kv_active_tokens / load.active_requests if load.active_requests > 0 else 0.0
    return profile.max_tpot_batch(cfg.tpot_s, mean_ctx, max_batch)


def dpi_load(load: DecodeLoad, n_tpot_batch: int) -> float:
    """Eq. 7: DPI_d,load = max(C_active / C_KV, N_active / N_TPOT).

    N_TPOT = 0 (no batch meets the SLO) is treated as 1 so the value stays finite and >= N.
    """
    kv_frac = load.kv_active_tokens / load.kv_capacity_tokens
    batch_frac = load.active_requests / (n_tpot_batch if n_tpot_batch > 0 else 1)
    return kv_frac if kv_frac > batch_frac else batch_frac


def dpi_adm(load: DecodeLoad) -> float:
    """Eq. 8: DPI_d,adm = 1 − C_alloc / C_KV (fraction occupied or reserved).

    Extension: when the worker also caps admitted requests (``max_requests`` > 0) and every
    slot is taken, it can admit nothing whatever its free KV, so its allocable capacity is
    0 and DPI_adm = 1. Below the cap the value is the paper's KV fraction. Without this, a
    decode pool that refuses admission because its slots are full looks idle to FluidRole
    (eq. 23), and a prefill backlog caused by that refusal is mistaken for prefill overload.
    (An earlier version returned max(KV fraction, N_admitted / N_max): it compared a slot
    fraction with DPI_adm^high = 0.2, a threshold the paper sets for KV occupancy, so eq. 23
    fired at 13 of 64 slots and FluidRole churned P→D / D→P on a prefill-bound mix.)
    """
    if load.max_requests > 0 and load.admitted_requests >= load.max_requests:
        return 1.0
    return 1.0 - kv_alloc_tokens(load) / load.kv_capacity_tokens


def tpot_slack_s(load: DecodeLoad, profile: LatencyProfile, cfg: PolicyConfig) -> float:
    """Eq. 14: Δ_d^TPOT = S_TPOT − T_iter(N_active, C_active) (negative when over the SLO)."""
    return cfg.tpot_s - profile.decode_iter_time_s(load.active_requests, load.kv_active_tokens)


def max_suffix_tokens(
    slack_s: float,
    profile: LatencyProfile,
    cfg: PolicyConfig,
    context_tokens: float | None = None,
) -> float:
    """Eq. 15–16: L_d,max^{sfx,TPOT} = T_sfx⁻¹(η·Δ_d^TPOT) on ``context_tokens`` of prefix
    context; 0 when the slack is <= 0.

    T_sfx grows with the context the suffix attends to. When the budget is advertised that
    context is unknown: ``context_tokens=None`` assumes cfg.budget_context_tokens (a typical
    prefix; 0 would be the paper's one-argument T_sfx, which over-states the allowance for
    every real prefix). Where the prefix is known (admission re-check, chunk sizing) callers
    pass it: ``suffix_allowance_tokens`` and ``suffix_chunk_tokens``.
    """
    if slack_s <= 0.0:
        return 0.0
    ctx = cfg.budget_context_tokens if context_tokens is None else context_tokens
    return profile.suffix_tokens_for(cfg.eta * slack_s, ctx)


def suffix_allowance_tokens(
    steal_budget: float,
    slack_s: float,
    context_tokens: int,
    profile: LatencyProfile,
    cfg: PolicyConfig,
) -> int:
    """Decode-side re-check at admission of a split request whose prefix (the context its
    suffix attends to) is ``context_tokens``: the suffix tokens accepted now, the advertised
    budget (eq. 17) capped by what fits in η·Δ^TPOT on that very context (eq. 15–16).
    0 when there is no slack. The live decode worker and the simulator both call this. Pure."""
    exact = max_suffix_tokens(slack_s, profile, cfg, context_tokens)
    return int(min(steal_budget, exact))


def suffix_chunk_tokens(
    slack_s: float,
    context_tokens: int,
    profile: LatencyProfile,
    cfg: PolicyConfig,
    *,
    decoding: bool,
    idle_chunk_tokens: int,
) -> int:
    """Prompt-chunk tokens (stolen suffix) one decode iteration may run on top of a prefix of
    ``context_tokens``: the longest chunk whose T_sfx fits in η·Δ^TPOT (eq. 16) — 0 when
    there is no slack (no minimum chunk: a chunk then would break TPOT for the whole batch).
    With no request decoding (``decoding`` False) nobody's TPOT is at risk and the chunk is
    ``idle_chunk_tokens``, which also guarantees the suffix progresses. The live decode
    worker and the simulator both call this. Pure."""
    if not decoding:
        return idle_chunk_tokens
    return int(max_suffix_tokens(slack_s, profile, cfg, context_tokens))


def offered_budget_tokens(steal_budget: float, pending_suffix_tokens: int) -> float:
    """The steal budget a decode worker offers (and re-checks against): eq. 17's B_steal less
    the suffix tokens it already accepted and has not run yet (they use the same slack)."""
    return max(0.0, steal_budget - pending_suffix_tokens)


def decode_load_from_pool(
    capacity_tokens: int,
    held_tokens: int,
    active_tokens: int,
    running: int,
    admitted: int,
    max_requests: int,
    *,
    waiting_kv_tokens: int = 0,
    waiting_requests: int = 0,
) -> DecodeLoad:
    """The DecodeLoad of a decode worker from its block pool, identically for the live
    worker and the simulator: C_KV = usable blocks × block size; C_active = Σ tokens of the
    runnable requests; C_reserved = held − C_active (pending transfers plus the decode
    horizon installed requests hold), so that C_alloc (eq. 6) is exactly the free pool.

    Requests refused for capacity and kept waiting by their prefill workers
    (``waiting_*``) are admission demand too: counted as reserved KV (at most the pool that
    is not active: DPI_adm stays a fraction of the pool, as in the paper) and as taken
    slots, so DPI_adm (eq. 8) shows a decode pool short of capacity, not merely full."""
    reserved = max(0, held_tokens - active_tokens) + waiting_kv_tokens
    return DecodeLoad(
        capacity_tokens,
        active_tokens,
        min(reserved, max(0, capacity_tokens - active_tokens)),
        running,
        admitted_requests=admitted + waiting_requests,
        max_requests=max_requests,
    )


def steal_budget_tokens(
    dpi_load_value: float, max_suffix: float, n_paired_prefill: int, cfg: PolicyConfig
) -> float:
    """Eq. 17 (with the eligibility test of eq. 12):

        B_d^steal = 0                      if DPI_d,load >= DPI_load^high
                    L_d,max^{sfx,TPOT}/|P| otherwise

    |P| = ``n_paired_prefill``, the prefill workers paired with d (0 → budget 0).
    """
    if dpi_load_value >= cfg.dpi_load_high or n_paired_prefill <= 0:
        return 0.0
    return max_suffix / n_paired_prefill


def decode_pressure(
    load: DecodeLoad,
    profile: LatencyProfile,
    cfg: PolicyConfig,
    n_paired_prefill: int,
    *,
    max_batch: int | None = None,
) -> DecodePressure:
    """All decode-side signals at once (eq. 6, 7, 8, 14, 16, 17); the decode worker publishes
    ``steal_budget_tokens`` (with its timestamp) for the prefill workers paired with it."""
    n_max = n_tpot(load, profile, cfg, max_batch)
    load_v = dpi_load(load, n_max)
    slack = tpot_slack_s(load, profile, cfg)
    l_max = max_suffix_tokens(slack, profile, cfg)
    return DecodePressure(
        dpi_load=load_v,
        dpi_adm=dpi_adm(load),
        kv_alloc_tokens=kv_alloc_tokens(load),
        n_tpot=n_max,
        tpot_slack_s=slack,
        max_suffix_tokens=l_max,
        steal_budget_tokens=steal_budget_tokens(load_v, l_max, n_paired_prefill, cfg),
    )
