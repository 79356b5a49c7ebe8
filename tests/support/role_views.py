"""WorkerViews for FluidRole's policy tests: busy prefill workers and decode workers with
their batch slots taken and requests waiting for one (shared/policy/cluster_view.py)."""

from __future__ import annotations

from collections.abc import Sequence

from shared.policy.cluster_view import WorkerView
from shared.policy.roles import DECODE, PREFILL

SLOTS = 64  # max_num_seqs of every decode worker built here


def busy_prefill(n: int, ppi: float) -> tuple[WorkerView, ...]:
    """``n`` Active prefill workers "p0", "p1", … at PPI^95 ``ppi``, computing all the time."""
    return tuple(WorkerView(f"p{i}", PREFILL, ppi_p95=ppi, prefill_busy_frac=1.0) for i in range(n))


def waiting_decode(
    waiting: Sequence[int], *, load: float, adm: float = 1.0, active: int = SLOTS
) -> tuple[WorkerView, ...]:
    """One Active decode worker "d0", "d1", … per entry of ``waiting``: ``active`` of its
    ``SLOTS`` slots taken, that many requests waiting for one, DPI_load ``load`` and DPI_adm
    ``adm`` as it reports them."""
    return tuple(
        WorkerView(
            f"d{i}",
            DECODE,
            dpi_load=load,
            dpi_adm=adm,
            active_decode_requests=active,
            decode_waiting=n,
            max_decode_requests=SLOTS,
        )
        for i, n in enumerate(waiting)
    )
