"""Prometheus metrics of the controller, in a private CollectorRegistry (never the global)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge


@dataclass(frozen=True)
class ControllerMetrics:
    registry: CollectorRegistry
    decisions_total: Counter  # label action: none / decode_to_prefill / prefill_to_decode
    switches_total: Counter  # label outcome: ok / refused / error
    ppi_bar: Gauge
    dpi_load_bar: Gauge
    dpi_adm_bar: Gauge
    workers: Gauge  # label role

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> ControllerMetrics:
        reg = registry or CollectorRegistry()
        return cls(
            registry=reg,
            decisions_total=Counter(
                "fluidpd_controller_decisions",
                "FluidRole decisions by action",
                ["action"],
                registry=reg,
            ),
            switches_total=Counter(
                "fluidpd_controller_switches",
                "switch commands sent, by outcome",
                ["outcome"],
                registry=reg,
            ),
            ppi_bar=Gauge("fluidpd_controller_ppi_bar", "PPI̅ (eq. 20)", registry=reg),
            dpi_load_bar=Gauge(
                "fluidpd_controller_dpi_load_bar", "DPI̅_load (eq. 21)", registry=reg
            ),
            dpi_adm_bar=Gauge("fluidpd_controller_dpi_adm_bar", "DPI̅_adm (eq. 21)", registry=reg),
            workers=Gauge(
                "fluidpd_controller_workers",
                "live workers in the policy view",
                ["role"],
                registry=reg,
            ),
        )
