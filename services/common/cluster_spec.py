"""What a local cluster (services/common/cluster.py) starts: ``ClusterSpec``, the one frozen,
validated description of its nats-server, controller, router and workers and their flags."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from services.common.cpus import check_cpus
from shared.policy.roles import DECODE, PREFILL, Role


@dataclass(frozen=True)
class ClusterSpec:
    """What to start. Immutable; validated on construction (raises ValueError).

    ``nats_url`` None starts a private nats-server. ``worker_args`` / ``router_args`` /
    ``controller_args`` are appended to the respective command lines; ``env`` is added to
    every child's environment. ``log_dir`` writes ``<name>.log`` files; ``log_to_terminal``
    prints every line prefixed with ``[name]``. ``control_cpus`` pins nats-server, the
    router and the controller, ``worker_cpus`` the workers (services/common/cpus.py;
    ``()``: not pinned); CPUs this process may not use raise CpuSetError (a ValueError).
    ``nats_auth`` (on by default, as ``fluidpd up`` ships): the private nats-server gets
    least-privilege users (services/common/nats_auth.py) and each child its own
    credentials; off, anyone may do anything on the bus (say why where a test needs it).
    With ``nats_url`` (a server started elsewhere) it is that server's business and
    ``nats_auth`` is ignored.
    """

    prefill: int = 1
    decode: int = 1
    model: str = "smollm2-135m"
    engine: str = "torch"
    port: int = 8000
    host: str = "127.0.0.1"
    nats_url: str | None = None
    profile: str = ""
    threads: int = 0
    time_scale: float | None = None
    log_json: bool = False
    auto_policy: bool = True
    policy_config: str = ""
    worker_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    controller_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    log_dir: Path | None = None
    log_to_terminal: bool = False
    with_controller: bool = True
    with_router: bool = True
    die_with_parent: bool = False
    stop_grace_s: float = 8.0
    control_cpus: tuple[int, ...] = ()
    worker_cpus: tuple[int, ...] = ()
    python: str = field(default_factory=lambda: sys.executable)
    nats_auth: bool = True

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 0 or self.prefill + self.decode < 1:
            raise ValueError("need at least one worker (prefill, decode >= 0)")
        if self.engine not in ("torch", "emulated"):
            raise ValueError("engine must be 'torch' or 'emulated'")
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in 0..65535 (0: the router binds a free one)")
        if self.stop_grace_s < 0:
            raise ValueError("stop_grace_s must be >= 0")
        check_cpus(self.control_cpus, "control plane CPUs")
        check_cpus(self.worker_cpus, "worker CPUs")

    def worker_ids(self) -> list[tuple[str, Role]]:
        """(worker id, role) for every worker: p0..p{N-1}, d0..d{M-1}."""
        return [(f"p{i}", PREFILL) for i in range(self.prefill)] + [
            (f"d{i}", DECODE) for i in range(self.decode)
        ]
