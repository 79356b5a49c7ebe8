"""ControllerConfig: how the controller connects, how often it decides, what it exposes."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.bus.config import BusConfig
from shared.policy.config import PolicyConfig


@dataclass(frozen=True)
class ControllerConfig:
    """Immutable; validated on construction (raises ValueError).

    ``policy.decision_interval_s`` is how often the FluidRole loop runs; ``auto`` is whether
    decided switches are sent to workers (``fluidpd ctl policy pause|resume`` flips it at
    run time). ``telemetry_stale_s``: a worker whose last telemetry is older than this
    contributes no pressure (its view falls back to zeros) — the registry still decides
    whether it is listed at all. ``metrics_port`` 0 means no /metrics endpoint.
    """

    # How to reach NATS (services/common/bus_flags.py makes it from the --nats* flags); the
    # controller names the connection after its id.
    bus: BusConfig = field(default_factory=BusConfig)
    subject_prefix: str = "fluidpd"
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    auto: bool = True
    switch_timeout_s: float = 5.0
    telemetry_stale_s: float = 5.0
    heartbeat_s: float = 1.0
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    controller_id: str = "controller"

    def __post_init__(self) -> None:
        for name in ("switch_timeout_s", "telemetry_stale_s", "heartbeat_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError("metrics_port must be in [0, 65535]")

    @property
    def decision_interval_s(self) -> float:
        return self.policy.decision_interval_s
