"""FluidToken stealing-ratio selection: the paper's Algorithm 1 (§IV-B3, eq. 9, 18, 19).

Run by each prefill worker at every scheduling iteration over its own queue, with the steal
budgets B_d^steal (eq. 17) most recently published by its paired decode workers.

Algorithm 1, as given in the paper (line numbers in the code refer to it):

    stolen_j ← 0 ∀j;  budget_d ← B_d^steal ∀d                       (3–4)
    for i ← 1..n:                                                    (5)
        compute X_i by eq. 19; if X_i <= 0: continue                  (6–9)
        need_i ← X_i                                                  (10)
        for j ← 1..i−1 (earliest first):                              (11)
            if need_i <= 0: break                                     (12–14)
            d ← d(j); take ← min(need_i, L_j − stolen_j, budget_d)    (15–16)
            stolen_j += take; budget_d −= take; need_i −= take        (17–19)
    β_j ← stolen_j / L_j                                              (22)

Interpretation where the paper leaves room (each is a choice, written down):

1. X_i is evaluated on the *current* stealing schedule (the paper: "applying the normal PPI
   schedulability condition to the modified stealing schedule"): Σ_{k<=i} T_pfx(L_pfx,k)
   already reflects the tokens taken for earlier requests. Because line 11 only takes from
   j < i, nothing has been stolen from request i itself when X_i is computed, so its prefix
   deadline (eq. 9) is still t_i^ddl. Requests are not re-checked after tokens are later
   taken from them; the suffix time this adds to j's own deadline is bounded separately by
   the decode-side budget (eq. 15), exactly as in the paper.
2. T_pfx(0) = 0: a fully stolen request (β = 1) removes its whole prefill, c0 included, from
   the prefill worker (see predictors.py). ``PolicyConfig.max_steal_ratio`` (default 1.0 =
   the paper) can cap β below 1.
3. Tokens are whole: need_i = ⌈X_i⌉ and budget_d = ⌊B_d⌋, so Σ β_i·L_i <= B_d holds exactly.
   A deficit below 1e-6 tokens is float rounding and counts as X_i <= 0.
4. A budget is used only if it was published at most ``cfg.budget_stale_ms`` before
   ``now_s``; a stale, missing or unknown decode worker's budget counts as 0.
5. The algorithm spends budget on a deficit it cannot close completely (it "draws tokens ...
   until either its deficit is closed or no eligible request remains"); since tokens always
   come from the earliest requests, they still advance every later request.
6. Extension: ``running_remaining_s`` (predicted rest of the prefill executing now) is added
   to every prefix sum; 0 reproduces the paper.

Complexity: O(n + D·n) for n requests and D decode workers — a request that can no longer
supply tokens is never scanned twice (the paper's line 11 loop is O(n²) when run literally).
The function also returns eq. 5's PPI of the unmodified queue, computed in the same pass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.policy.config import PolicyConfig
from shared.policy.predictors import LatencyProfile
from shared.policy.prefill_pressure import QueuedRequest

_TOKEN_DUST = 1e-6  # deficits below this many tokens are float rounding, not lateness


@dataclass(frozen=True, slots=True)
class StealBudget:
    """B_d^steal (tokens, eq. 17) as published by decode worker d at ``published_s``."""

    tokens: float
    published_s: float


@dataclass(frozen=True, slots=True)
class StealPlan:
    """Result of one Algorithm 1 run. Sparse: requests not listed have β = 0.

    ``stolen_tokens``: queue index → L_sfx (suffix tokens for the decode worker);
    ``betas``: queue index → β = L_sfx / L; ``usage_tokens``: decode id → Σ L_sfx taken;
    ``budget_tokens``: decode id → usable budget ⌊B_d⌋ after the staleness check;
    ``ppi``: eq. 5 over the queue before stealing; ``at_risk``: requests with X_i > 0 when
    examined; ``unresolved``: of those, how many kept a positive deficit.
    """

    ppi: float
    stolen_tokens: dict[int, int]
    betas: dict[int, float]
    usage_tokens: dict[str, int]
    budget_tokens: dict[str, int]
    at_risk: int
    unresolved: int

    def beta(self, index: int) -> float:
        return self.betas.get(index, 0.0)

    def beta_list(self, n: int) -> list[float]:
        """Dense β_1..β_n (allocates; for logs and tests)."""
        return [self.betas.get(i, 0.0) for i in range(n)]


def usable_budgets(
    budgets: Mapping[str, StealBudget], cfg: PolicyConfig, now_s: float
) -> dict[str, int]:
    """decode id → ⌊B_d⌋ for every budget that is fresh (published within the staleness
    bound; a timestamp in the future counts as fresh) and at least one token."""
    oldest_ok = now_s - cfg.budget_stale_s
    return {
        d: int(b.tokens)
        for d, b in budgets.items()
        if b.published_s >= oldest_ok and b.tokens >= 1.0
    }


def select_steal_ratios(
    queue: Sequence[QueuedRequest],
    budgets: Mapping[str, StealBudget],
    profile: LatencyProfile,
    cfg: PolicyConfig,
    now_s: float,
    *,
    running_remaining_s: float = 0.0,
) -> StealPlan:
    """Algorithm 1 over ``queue`` (scheduling order). Pure: reads its inputs, mutates none.

    Guarantees: 0 <= β_i <= cfg.max_steal_ratio <= 1, and for every decode worker d,
    Σ_{i: d(i)=d} β_i·L_i <= ⌊B_d⌋ (0 for stale or unknown d).
    """
    c1 = profile.prefill_c1_s_per_token
    c0 = profile.prefill_c0_s
    ttft_s = cfg.ttft_s
    eps_s = cfg.ppi_epsilon_s
    ratio = cfg.max_steal_ratio
    whole = ratio >= 1.0
    effective = usable_budgets(budgets, cfg, now_s)
    remaining = dict(effective)  # budget_d (line 4)
    total = sum(remaining.values())  # Σ_d budget_d: 0 means no more stealing this call
    stolen: dict[int, int] = {}  # stolen_j (line 3), sparse
    live: list[int] = []  # j that may still supply tokens, queue order; live[:head] are dead
    head = 0
    dried = False  # some decode budget reached 0 since live was last compacted
    cum_s = running_remaining_s  # Σ_{k<=i} T_pre(L_k), unmodified queue (eq. 3–5)
    removed_s = 0.0  # prefill time the steals so far removed from the queue
    worst = 0.0
    at_risk = 0
    unresolved = 0
    base_s = ttft_s - now_s  # t_i^ddl − t_now = t_i^arr + base_s (eq. 1)
    rest = iter(queue)
    i = -1
    if total > 0:
        for r in rest:
            i += 1
            tokens_i = r.prompt_tokens
            cum_s += c1 * tokens_i + c0
            slack_s = r.arrival_s + base_s
            p = cum_s / (slack_s if slack_s > eps_s else eps_s)  # eq. 4
            if p > worst:
                worst = p
            # Eq. 19 times c1 (interpretation 1: L_sfx,i = 0 so t_i^{pfx-ddl} = t_i^ddl).
            excess_s = cum_s - removed_s - slack_s
            # Line 7: X_i > 0, and need = ⌈X_i⌉ (line 10) ignoring float dust below 1e-6
            # tokens (0.1 + 0.5 + 1.0 + 0.8 − 2.0 is 0.4000000000000001, not 0.4).
            need = 0
            if excess_s > 0.0:
                x = excess_s / c1 - _TOKEN_DUST
                need = int(x)
                if need < x:
                    need += 1
            if need > 0:
                at_risk += 1
                k = head
                n_live = len(live)
                while k < n_live:  # line 11: earliest first
                    j = live[k]
                    rj = queue[j]
                    d = rj.decode_id  # line 15
                    budget_d = remaining[d]
                    tokens_j = rj.prompt_tokens
                    stolen_j = stolen.get(j, 0)
                    avail = (tokens_j if whole else int(ratio * tokens_j)) - stolen_j
                    if avail <= 0 or budget_d <= 0:  # not eligible (and never again)
                        k += 1
                        continue
                    take = need if need < avail else avail  # line 16
                    if budget_d < take:
                        take = budget_d
                    stolen_j += take  # lines 17–19
                    stolen[j] = stolen_j
                    budget_d -= take
                    remaining[d] = budget_d
                    total -= take
                    need -= take
                    removed_s += c1 * take
                    if stolen_j == tokens_j:
                        removed_s += c0  # T_pfx(0) = 0 (interpretation 2)
                    if budget_d <= 0:
                        dried = True
                    if need <= 0 or total <= 0:  # lines 12–13
                        break
                    k += 1  # j exhausted or d dry: everything up to k is now dead
                head = k
                if need > 0:
                    unresolved += 1
                if total <= 0:
                    break  # no budget left anywhere: the rest is PPI bookkeeping only
                if dried:
                    # Compact once per decode worker running dry: keeps the scan linear.
                    live = [jj for jj in live[head:] if remaining[queue[jj].decode_id] > 0]
                    head = 0
                    dried = False
            if remaining.get(r.decode_id, 0) > 0 and (whole or int(ratio * tokens_i) > 0):
                live.append(i)  # R_i may supply tokens to later requests
    # No budget left: Algorithm 1 changes nothing more; finish eq. 4–5 and count deficits.
    late_s = removed_s + _TOKEN_DUST * c1  # X_i > 0 ⟺ cum − slack > removed (+ dust)
    tail_risk = 0
    for r in rest:
        cum_s += c1 * r.prompt_tokens + c0
        slack_s = r.arrival_s + base_s
        p = cum_s / (slack_s if slack_s > eps_s else eps_s)
        if p > worst:
            worst = p
        if cum_s - slack_s > late_s:
            tail_risk += 1
    at_risk += tail_risk
    unresolved += tail_risk
    betas = {j: s / queue[j].prompt_tokens for j, s in stolen.items()}
    usage = {d: effective[d] - remaining[d] for d in effective}
    return StealPlan(
        ppi=worst,
        stolen_tokens=stolen,
        betas=betas,
        usage_tokens=usage,
        budget_tokens=effective,
        at_risk=at_risk,
        unresolved=unresolved,
    )
