"""Prefill pressure of FluidPD (paper §IV-B2, §IV-C): the PPI of a prefill worker's queue
(eq. 1, 3–5) and the PPI of a queue with stolen suffixes (eq. 9–11, 19), which Algorithm 1
(fluidtoken.py) plans with. The decode side (DPI, TPOT slack, steal budget) is pressure.py.

Pure functions over plain numbers and small dataclasses; every function names the equation
it implements. Times are seconds, sizes are tokens. ``now_s`` is always passed in.

Symbols: S_TTFT — the TTFT SLO; L_i — prompt length of queued request i; t_i^arr — arrival;
L_sfx,i / L_pfx,i — its stolen suffix / the prefix its prefill worker computes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.policy.config import PolicyConfig
from shared.policy.predictors import LatencyProfile


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    """One request waiting on a prefill worker, as the policy sees it.

    ``decode_id`` names the decode worker the router paired it with (π_{i,d} = 1).
    """

    request_id: str
    arrival_s: float
    prompt_tokens: int
    decode_id: str


def prefill_deadline_s(arrival_s: float, ttft_s: float) -> float:
    """Eq. 1: t_i^ddl = t_i^arr + S_TTFT."""
    return arrival_s + ttft_s


def request_ppis(
    queue: Sequence[QueuedRequest],
    profile: LatencyProfile,
    cfg: PolicyConfig,
    now_s: float,
    *,
    running_remaining_s: float = 0.0,
) -> list[float]:
    """Eq. 3–4 for each queued request, in the given scheduling order:

        PPI_i = Σ_{k<=i} T_pre(L_k) / max(t_i^ddl − t_now, ε)

    ε (cfg.ppi_epsilon_ms) keeps the denominator positive once a deadline has passed, so an
    expired request shows a large (not negative or infinite) pressure. Extension: the
    predicted remaining time of the prefill already executing, ``running_remaining_s``, is
    added to every sum (the paper's eq. 3 starts from an idle worker; 0 reproduces it).
    """
    c1, c0 = profile.prefill_c1_s_per_token, profile.prefill_c0_s
    ttft_s, eps_s = cfg.ttft_s, cfg.ppi_epsilon_s
    cum = running_remaining_s
    out = []
    for r in queue:
        cum += c1 * r.prompt_tokens + c0
        remaining = r.arrival_s + ttft_s - now_s
        out.append(cum / (remaining if remaining > eps_s else eps_s))
    return out


def queue_ppi(
    queue: Sequence[QueuedRequest],
    profile: LatencyProfile,
    cfg: PolicyConfig,
    now_s: float,
    *,
    running_remaining_s: float = 0.0,
) -> float:
    """Eq. 5: PPI = max_i PPI_i over the inspected queue (0.0 for an empty queue).

    Same terms as ``request_ppis``, without building the list (hot path).
    """
    c1, c0 = profile.prefill_c1_s_per_token, profile.prefill_c0_s
    ttft_s, eps_s = cfg.ttft_s, cfg.ppi_epsilon_s
    cum = running_remaining_s
    worst = 0.0
    for r in queue:
        cum += c1 * r.prompt_tokens + c0
        remaining = r.arrival_s + ttft_s - now_s
        p = cum / (remaining if remaining > eps_s else eps_s)
        if p > worst:
            worst = p
    return worst


def prefix_deadline_s(
    deadline_s: float, suffix_tokens: float, prompt_tokens: float, profile: LatencyProfile
) -> float:
    """Eq. 9: t_i^{pfx-ddl} = t_i^ddl − T_sfx(L_sfx,i), the suffix running on the prefix
    context L_ctx = L_i − L_sfx,i. Equals t_i^ddl when nothing is stolen."""
    return deadline_s - profile.suffix_time_s(suffix_tokens, prompt_tokens - suffix_tokens)


def token_deficit(
    prefix_work_s: float, prefix_deadline: float, now_s: float, profile: LatencyProfile
) -> float:
    """Eq. 19: X_i = (Σ_{k<=i} T_pfx(L_pfx,k) − (t_i^{pfx-ddl} − t_now)) / c1.

    ``prefix_work_s`` is the sum Σ_{k<=i} T_pfx(L_pfx,k). X_i <= 0: request i is predicted to
    meet its deadline; otherwise X_i tokens must leave the prefill queue ahead of it.
    """
    return (prefix_work_s - (prefix_deadline - now_s)) / profile.prefill_c1_s_per_token


def ppi_steal_values(
    queue: Sequence[QueuedRequest],
    stolen_tokens: Mapping[int, int],
    profile: LatencyProfile,
    cfg: PolicyConfig,
    now_s: float,
    *,
    running_remaining_s: float = 0.0,
) -> list[float]:
    """Eq. 11: PPI_i^steal = Σ_{k<=i} T_pfx(L_pfx,k) / max(t_i^{pfx-ddl} − t_now, ε).

    ``stolen_tokens`` maps queue index → L_sfx (absent = 0). A plan is TTFT-schedulable
    (eq. 10) when every value is <= 1. Used to check plans, not on the hot path.
    """
    ttft_s, eps_s = cfg.ttft_s, cfg.ppi_epsilon_s
    cum = running_remaining_s
    out = []
    for i, r in enumerate(queue):
        sfx = stolen_tokens.get(i, 0)
        cum += profile.prefix_time_s(r.prompt_tokens - sfx)
        pfx_ddl = prefix_deadline_s(r.arrival_s + ttft_s, sfx, r.prompt_tokens, profile)
        remaining = pfx_ddl - now_s
        out.append(cum / (remaining if remaining > eps_s else eps_s))
    return out
