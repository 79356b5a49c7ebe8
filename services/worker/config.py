"""The worker's one frozen config. Built by ``__main__`` from flags and environment."""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass, field

from shared.bus.config import BusConfig
from shared.engine.defaults import DEFAULT_KV_CACHE_BYTES, check_device_name
from shared.policy.admission import DEFAULT_EXPIRE_MARGIN_S
from shared.policy.roles import ROLES, Role

ENGINES = ("torch", "emulated")
# Prompt tokens one decode iteration carries when nothing else decodes (the policy's chunk
# budget applies while requests decode): not a flag.
PREFILL_CHUNK_TOKENS = 512


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker process needs to know before it starts. Validated on creation.

    ``short_prompt_tokens``: prompts up to this length are served entirely on one (decode)
    worker by the router; workers only need it for telemetry. ``prefill_batch_size`` is how
    many queued prompts one prefill iteration may compute (FIFO; 1 by default).
    """

    worker_id: str
    role: Role
    # How to reach NATS (services/common/bus_flags.py makes it from the --nats* flags); the
    # runtime names the connection after the worker.
    bus: BusConfig = field(default_factory=BusConfig)
    subject_prefix: str = "fluidpd"
    engine: str = "torch"
    device: str = "cpu"  # cpu | cuda | cuda:N (torch engine)
    dtype: str = "auto"  # auto (bfloat16 on CUDA, else float32) | float32 | bfloat16 | float16
    model: str = "tiny"
    profile: str = ""
    num_threads: int = 0
    block_size: int = 16
    num_kv_blocks: int = 0
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    gpu_memory_utilization: float = 0.0  # > 0: KV arena from this device-memory fraction
    max_model_len: int = 0  # 0: the model's (emulated: the profile's) context limit
    kv_zero_on_free: bool = False
    emulated_kv_bytes_per_token: int = 16
    time_scale: float = 1.0
    max_num_seqs: int = 64
    # Decode tokens reserved at admission beyond the prompt; longer outputs grow as they go.
    decode_reserve_tokens: int = 256
    prefill_batch_size: int = 1
    cluster_secret: str = field(default="", repr=False)
    heartbeat_s: float = 1.0
    telemetry_interval_s: float = 0.02
    transfer_timeout_s: float = 10.0
    admit_timeout_s: float = 5.0
    # An accepted request waits this long for decode capacity (its KV held on the prefill
    # worker) before it ends with a clear decode_wait_timeout error.
    decode_wait_timeout_s: float = 60.0
    # A queued prefill is dropped once its TTFT deadline passed by this much (< 0: never);
    # the one default shared with the router bench and the simulator (policy/admission.py).
    expire_margin_s: float = DEFAULT_EXPIRE_MARGIN_S
    request_timeout_s: float = 600.0
    ttft_slo_ms: float = 2000.0
    tpot_slo_ms: float = 100.0
    fluidtoken: bool = True
    force_steal_ratio: float = -1.0  # >= 0: split every prompt at this beta (tests, debugging)
    policy_config: str = ""
    recalibrate: bool = True  # refit the latency profile online from observed step times
    migrate: bool = True  # D->P switch: live-migrate long decodes to peers instead of waiting
    # ... those expected to need longer than this to finish (the rest finish in place).
    migrate_min_remaining_s: float = 0.2
    metrics_port: int = 0  # 0: no /metrics HTTP server
    metrics_host: str = "127.0.0.1"
    host: str = field(default_factory=socket.gethostname)
    log_json: bool = False

    def __post_init__(self) -> None:
        if not self.worker_id or any(c in self.worker_id for c in ". *>\t\n"):
            raise ValueError(f"worker_id must be a non-empty NATS token, got {self.worker_id!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        check_device_name(self.device)
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.migrate_min_remaining_s < 0:
            raise ValueError("migrate_min_remaining_s must be >= 0")
        if self.force_steal_ratio >= 1.0:
            raise ValueError("force_steal_ratio must be < 1 (a prefix of one token at least)")
        if self.prefill_batch_size <= 0 or self.max_num_seqs <= 0:
            raise ValueError("prefill_batch_size and max_num_seqs must be > 0")
        if math.isnan(self.expire_margin_s) or math.isinf(self.expire_margin_s):
            raise ValueError("expire_margin_s must be a finite number of seconds (< 0: off)")
        if self.decode_reserve_tokens < 0:
            raise ValueError("decode_reserve_tokens must be >= 0")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")
        if not 0.0 <= self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.gpu_memory_utilization > 0 and (
            self.engine != "torch" or not self.device.startswith("cuda")
        ):
            raise ValueError(
                "gpu_memory_utilization needs the torch engine on a CUDA device; use --kv-cache-mib"
            )
        for name in (
            "heartbeat_s",
            "telemetry_interval_s",
            "transfer_timeout_s",
            "admit_timeout_s",
            "decode_wait_timeout_s",
            "request_timeout_s",
            "ttft_slo_ms",
            "tpot_slo_ms",
            "time_scale",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if not self.cluster_secret.strip():
            # The secret seals KV tickets and envelopes: a well-known default would let any
            # host that reaches UCX write into this worker's blocks.
            raise ValueError(
                "no cluster secret: set FLUIDPD_CLUSTER_SECRET (the same on every worker; "
                "`fluidpd up` generates one)"
            )

    @property
    def expire_margin(self) -> float | None:
        """The expiry margin in seconds, None when expiry is off."""
        return None if self.expire_margin_s < 0 else self.expire_margin_s

    @property
    def secret_bytes(self) -> bytes:
        return self.cluster_secret.encode()


def default_worker_id(role: Role) -> str:
    return f"{role[0]}-{socket.gethostname().split('.')[0]}-{os.getpid()}"
