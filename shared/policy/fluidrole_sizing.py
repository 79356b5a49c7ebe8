"""How many workers one FluidRole decision moves (ADAPTIVE rules; PAPER always moves one).

Pressure scales, to first order, with the inverse of the number of workers sharing it: PPI̅
(eq. 20) with 1/|P|, DPI̅_load and DPI̅_adm (eq. 21) with 1/|D|. A move of k workers is
sized so that the pressured phase lands in the middle of its hysteresis band, and is
bounded so that the phase giving the workers up stays out of the band that would trigger
the move back:

* D→P: k = ⌈|P|·PPI̅ / PPI_mid − |P|⌉, PPI_mid = (PPI_low + PPI_high) / 2, bounded by
  |D|·DPI̅_load / (|D| − k) < DPI_load^high and |D|·DPI̅_adm / (|D| − k) < the D→P
  admission guard (fluidrole.adm_guard).
* P→D: k = ⌈|D|·DPI̅_adm / ADM_mid − |D|⌉, ADM_mid = (DPI_adm^high + guard) / 2, bounded
  by |P|·PPI̅ / (|P| − k) < PPI_low — except when the decode pool's saturated admission is
  what blocks prefill (``decode_blocked``, fluidrole rule 5): PPI̅ then measures decode
  backpressure, not prefill work, and taking prefill workers away does not raise it.

At least one worker moves when the rules recommend a move (the recommendation already
checked k = 1's preconditions, eq. 22–23), at most ``cfg.max_move_workers``, and the
source role keeps at least one Active worker. Pure.
"""

from __future__ import annotations

import math

from shared.policy.config import PolicyConfig

D2P = "decode_to_prefill"
P2D = "prefill_to_decode"


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
) -> int:
    """Workers to move for ``action`` (D2P | P2D) under ADAPTIVE rules (module doc); 0 when
    the source role cannot give any (fewer than 2 Active workers)."""
    cap = cfg.max_move_workers
    if action == D2P:
        if n_decode < 2:
            return 0
        mid = 0.5 * (cfg.ppi_low + cfg.ppi_high)
        need = math.ceil(n_prefill * ppi_bar / mid - n_prefill - 1e-9) if n_prefill else 1
        k_load = _largest_k(n_decode, dpi_load_bar, cfg.dpi_load_high, cap)
        k_adm = _largest_k(n_decode, dpi_adm_bar, adm_guard(cfg), cap)
        k = min(need, k_load, k_adm, cap, n_decode - 1)
        return max(1, k)
    if action == P2D:
        if n_prefill < 2:
            return 0
        mid = 0.5 * (cfg.dpi_adm_high + adm_guard(cfg))
        need = math.ceil(n_decode * dpi_adm_bar / mid - n_decode - 1e-9) if n_decode else 1
        k_ppi = cap if decode_blocked else _largest_k(n_prefill, ppi_bar, cfg.ppi_low, cap)
        k = min(need, k_ppi, cap, n_prefill - 1)
        return max(1, k)
    return 0
