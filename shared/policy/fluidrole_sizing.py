"""How many workers one FluidRole decision moves (ADAPTIVE rules; PAPER always moves one).

Pressure scales, to first order, with the inverse of the number of workers sharing it: PPI̅
(eq. 20) with 1/|P|, DPI̅_load and DPI̅_adm (eq. 21) with 1/|D|. A move of k workers is
sized so that the pressured phase lands in the middle of its hysteresis band, and is
bounded so that the phase giving the workers up stays clear of the band that would trigger
the move back:

* D→P: k = ⌈|P|·PPI̅ / PPI_mid − |P|⌉, PPI_mid = (PPI_low + PPI_high) / 2, bounded by the
  *predicted* decode load after the move, with a margin: |D|·DPI̅_load / (|D| − k) <
  DPI_load^high − ``d2p_load_margin``, |D|·DPI̅_adm / (|D| − k) < the D→P admission guard
  (``adm_guard``), and, when the workers' batch limit is known, the decode backlog (running
  decodes + requests waiting for decode admission, ``DecodeDemand``) — or, when larger, the
  backlog the flow entering decode settles at (``forecast_requests``, decode_flow.py) scaled
  by (|P| + k) / |P| for the requests k more prefill workers send — fills at most
  ``decode_fill_target`` of the remaining decode slots. The margin is there because the
  decode load measured while prefill is the bottleneck is throttled by it: more prefill
  workers send more requests to decode (a 5P3D → 7P1D move at DPI̅_load 0.08 saturated the
  one decode worker within 20 s on azure-mixed). Unlike the other bounds these also refuse
  k = 1 (0 = no move).
* P→D: k = the largest of ⌈|D|·DPI̅_adm / ADM_mid − |D|⌉ (ADM_mid = (DPI_adm^high + guard)
  / 2), the workers the decode backlog needs at ``decode_fill_target`` and, when DPI̅_load
  is over DPI_load^high (with ``p2d_load_trigger`` on), ⌈|D|·DPI̅_load / DPI_load^high −
  |D|⌉ (the workers that bring the decode load back under its bound), bounded by
  |P|·PPI̅ / (|P| − k) < PPI_low — or < PPI_high when decode admission is saturated
  (DPI̅_adm >= DPI_adm^blocking: the demand is censored by the full slots, so the decode gap
  under-states it, and only PPI̅ > PPI_high moves workers back) — and not bounded at all
  when the saturated decode admission is what blocks prefill (``decode_blocked``, fluidrole
  rule 5): PPI̅ then measures decode backpressure, not prefill work. When the slots are full
  (DPI̅_adm >= DPI_adm^blocking) and the batch limit is known, k is what the backlog needs
  alone: DPI̅_adm is censored at 1 there and its gap always asks for ~2.7x the decode
  workers. Every P→D move is also bounded by the prefill workers' *predicted busy
  fraction*, Σ busy / (|P| − k) < ``p2d_busy_bound`` (shared/policy/busy.py): PPI̅ is a
  queue measure, near 0 whenever a queue happens to be empty, so it cannot tell how much
  prefill capacity the arrivals use; the busy fraction can. One exception: when the
  decode backlog (or its forecast) exceeds every decode slot, decode is what binds, and a
  prefill worker over the busy bound still moves — one, not the gap (the gap overshot at
  mixed 120 rps: 5P3D → 2P6D, then back).

P→D moves at least one worker when the rules recommend it (they checked k = 1's
preconditions, eq. 23) unless even one would leave prefill over its busy bound (0 = no
move); every move is at most ``cfg.max_move_workers`` and leaves the source role at least
one Active worker. Pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.policy.config import PolicyConfig

D2P = "decode_to_prefill"
P2D = "prefill_to_decode"


@dataclass(frozen=True, slots=True)
class DecodeDemand:
    """The decode backlog — requests that hold a decode slot or wait for one — and the slots
    one decode worker has (its ``max_num_seqs``; 0 = unknown: no demand bound). Requests
    still queued for prefill are not counted: counting them refused the D→P moves a
    prefill-bound stage needs (they reach decode at the prefill rate, not at once)."""

    requests: int = 0
    slots_per_worker: int = 0
    # λ·W of the flow entering decode (shared/policy/decode_flow.py; 0 = not known): the
    # backlog the present flow settles at, which the backlog now understates in a ramp.
    forecast_requests: float = 0.0

    def workers_needed(self, fill_target: float, flow_scale: float = 1.0) -> int:
        """Decode workers that keep the larger of the backlog and the forecast (scaled by
        ``flow_scale``: the flow after a move) within ``fill_target`` of their slots (0 when
        the slots are unknown)."""
        if self.slots_per_worker <= 0 or fill_target <= 0:
            return 0
        load = max(float(self.requests), self.forecast_requests * flow_scale)
        return math.ceil(load / (self.slots_per_worker * fill_target) - 1e-9)

    def binds(self, n_decode: int) -> bool:
        """Decode is what binds: the backlog (or its forecast) needs more than ``n_decode``
        workers even with every slot full (False when the slots are unknown)."""
        return self.workers_needed(1.0) > n_decode


def adm_guard(cfg: PolicyConfig) -> float:
    """DPI̅_adm above which no decode worker is taken away (between DPI_adm^high and the
    blocking level, so P→D and D→P cannot chase each other around one threshold)."""
    return 0.5 * (cfg.dpi_adm_high + cfg.dpi_adm_blocking)


def _largest_k(n: int, value: float, bound: float, k_hi: int) -> int:
    """Largest k in [0, k_hi] with n·value / (n − k) < bound (0 if even k = 1 fails)."""
    best = 0
    for k in range(1, min(k_hi, n - 1) + 1):
        if n * value / (n - k) < bound:
            best = k
    return best


def d2p_gap(ppi_bar: float, n_prefill: int, cfg: PolicyConfig) -> int:
    """Workers a D→P move needs to bring PPI̅ to the middle of its band (module doc), at
    least 1 and before any bound: ⌈|P|·PPI̅ / PPI_mid − |P|⌉."""
    if not n_prefill:
        return 1
    mid = 0.5 * (cfg.ppi_low + cfg.ppi_high)
    return max(1, math.ceil(n_prefill * ppi_bar / mid - n_prefill - 1e-9))


def move_size(
    action: str,
    ppi_bar: float,
    dpi_load_bar: float,
    dpi_adm_bar: float,
    n_prefill: int,
    n_decode: int,
    cfg: PolicyConfig,
    *,
    decode_blocked: bool = False,
    demand: DecodeDemand | None = None,
    prefill_busy: float = 0.0,
) -> int:
    """Workers to move for ``action`` (D2P | P2D) under ADAPTIVE rules (module doc); 0 when
    the source role cannot give any (fewer than 2 Active workers) or when even one worker
    would leave the other side over its predicted-load bounds (D2P: decode load, backlog;
    P2D: ``prefill_busy``, the Active prefill workers' mean busy fraction)."""
    cap = cfg.max_move_workers
    demand = demand or DecodeDemand()
    if action == D2P:
        if n_decode < 2:
            return 0
        need = d2p_gap(ppi_bar, n_prefill, cfg)
        load_bound = cfg.dpi_load_high - cfg.d2p_load_margin
        k_load = _largest_k(n_decode, dpi_load_bar, load_bound, cap)
        k_adm = _largest_k(n_decode, dpi_adm_bar, adm_guard(cfg), cap)
        k_demand = cap
        for kk in range(1, min(cap, n_decode - 1) + 1):
            # Prefill-bound arrivals: k more prefill workers send ~(|P| + k)/|P| the flow.
            scale = 1.0 + kk / n_prefill if n_prefill else 1.0
            needed_d = demand.workers_needed(cfg.decode_fill_target, scale)
            if needed_d and n_decode - kk < needed_d:
                k_demand = kk - 1
                break
        k = min(need, k_load, k_adm, k_demand, cap, n_decode - 1)
        return max(0, k)
    if action == P2D:
        if n_prefill < 2:
            return 0
        mid = 0.5 * (cfg.dpi_adm_high + adm_guard(cfg))
        needed_d = demand.workers_needed(cfg.decode_fill_target)
        if needed_d and dpi_adm_bar >= cfg.dpi_adm_blocking:
            # Full slots censor DPI_adm at 1: its gap says nothing of how much decode
            # capacity is missing (it always asked for ~2.7x), the backlog does.
            need = needed_d - n_decode
        else:
            gap = math.ceil(n_decode * dpi_adm_bar / mid - n_decode - 1e-9) if n_decode else 1
            need = max(gap, needed_d - n_decode)
        if cfg.p2d_load_trigger > 0 and n_decode and dpi_load_bar > cfg.dpi_load_high:
            # Decode load over its bound: enough workers to bring it back under it.
            load_gap = n_decode * dpi_load_bar / cfg.dpi_load_high - n_decode
            need = max(need, math.ceil(load_gap - 1e-9))
        k_busy = cap
        if cfg.p2d_busy_bound > 0:
            k_busy = _largest_k(n_prefill, prefill_busy, cfg.p2d_busy_bound, cap)
            if k_busy == 0 and demand.binds(n_decode):
                # Both phases are short, but decode binds: its backlog (or where the flow
                # settles) exceeds every decode slot, so computed prompts wait for decode
                # and prefill's busy time is partly wasted. One worker goes, not the gap.
                k_busy = 1
            if k_busy == 0:  # prefill has no capacity to give: both phases are short
                return 0
        if decode_blocked:
            k_ppi = cap
        elif dpi_adm_bar >= cfg.dpi_adm_blocking:
            k_ppi = _largest_k(n_prefill, ppi_bar, cfg.ppi_high, cap)
        else:
            k_ppi = _largest_k(n_prefill, ppi_bar, cfg.ppi_low, cap)
        k = min(need, k_ppi, k_busy, cap, n_prefill - 1)
        return max(1, k)
    return 0
