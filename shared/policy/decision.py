"""One FluidRole decision and the numbers it publishes (shared/policy/fluidrole.py decides;
the controller logs and publishes it as ``ControllerDecision``, docs/subjects.md). Pure."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from shared.policy.decode_flow import DecodeFlow
from shared.policy.fluidrole_rules import NONE


@dataclass(frozen=True, slots=True)
class Decision:
    """One decision interval's outcome. ``action`` is NONE, D2P or P2D; ``worker_id`` and
    ``target_role`` are set only when switching. ``recommendation`` is what eq. 22/23 say
    this interval (NONE, D2P or P2D), ``persist_count`` how many consecutive intervals it held.
    """

    now_s: float
    action: str
    worker_id: str | None
    target_role: str | None
    reason: str
    recommendation: str
    persist_count: int
    ppi_bar: float
    dpi_load_bar: float
    dpi_adm_bar: float
    active_prefill: int
    active_decode: int
    # Every worker this decision moves (worker_id is the first); () when not switching.
    worker_ids: tuple[str, ...] = ()
    # The decode flow the sizing read (decode_flow.py); None when the policy keeps none.
    decode_flow: DecodeFlow | None = None
    # PPI̅ as it is now (cluster_view.prefill_ppi_now), which a P→D recommendation may read.
    ppi_now: float | None = None
    # The DPI_adm value ADAPTIVE's D→P admission guard compared (max of the smoothed and the
    # present reading); None under PAPER rules, which have no guard.
    dpi_adm_guard: float | None = None
    # The least decode backlog waiting for admission over the Active decode workers, in
    # batches (cluster_view.decode_waiting_batches), which ADAPTIVE's "decode admission
    # blocks prefill" reads; None under PAPER rules or when no batch limit is reported.
    decode_waiting_batches: float | None = None

    @property
    def switches(self) -> bool:
        return self.action != NONE

    def inputs(self, num_workers: int) -> dict[str, float]:
        """The named numbers published with this decision (``ControllerDecision.inputs``,
        docs/subjects.md): with ``ppi_now``, ``dpi_adm_guard`` and ``decode_waiting_batches``,
        enough for ``recommend`` to give this decision's recommendation again (bench shift
        re-derives it). Pure."""
        out = {
            "ppi_bar": self.ppi_bar,
            "dpi_load_bar": self.dpi_load_bar,
            "dpi_adm_bar": self.dpi_adm_bar,
            "persist_count": float(self.persist_count),
            "active_prefill": float(self.active_prefill),
            "active_decode": float(self.active_decode),
            "workers": float(num_workers),
            "move_workers": float(len(self.worker_ids)),
        }
        if self.ppi_now is not None:
            out["ppi_now"] = self.ppi_now
        if self.dpi_adm_guard is not None:
            out["dpi_adm_guard"] = self.dpi_adm_guard
        if self.decode_waiting_batches is not None:
            out["decode_waiting_batches"] = self.decode_waiting_batches
        if self.decode_flow is not None:  # FluidRole's decode flow forecast (sizing)
            out["decode_flow_entered"] = self.decode_flow.entered
            out["decode_flow_left"] = self.decode_flow.left
            out["decode_flow_forecast"] = self.decode_flow.requests
        return out

    def to_log(self) -> dict[str, Any]:
        return asdict(self)
