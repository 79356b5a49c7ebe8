"""SimConfig: one simulated FluidPD cluster, and the named configurations of the paper's §V.

Every default mirrors the real worker, router and controller (services/worker/config.py,
services/worker/decode/decode_role.py, services/router/pairing.py, services/controller); the
FluidToken/FluidRole thresholds come from ``PolicyConfig`` (shared/policy/config.py), the
latency model from the shipped profile. Values the real system does not have (the KV link,
the switch overhead) are named as modelling choices on their field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from shared.policy.admission import SheddingConfig, paper_baseline_shedding
from shared.policy.config import PolicyConfig
from shared.policy.errors import PolicyConfigError

STATIC = "static"  # fixed split, round robin, no stealing, no switching (SGLang-like baseline)
# Fixed split, pressure pairing, no stealing, no switching: pairing's share of the gain.
STATIC_PRESSURE = "static-pressure"
# The paper's own baseline (§V-C): static, and no door; queued work aborted 60 s after
# arrival. Every other configuration keeps the base's shedding (the router's door).
STATIC_PAPER = "static-paper"
TOKEN = "token"  # FluidToken only
ROLE = "role"  # FluidRole only
FULL = "full"  # FluidToken + FluidRole
ORACLE = "oracle"  # best static split per window in hindsight (run.py)
# The oracle's per-window splits applied to one continuous run (oracle_live.py): a yardstick.
ORACLE_LIVE = "oracle-live"
CONFIGS = (STATIC, STATIC_PRESSURE, TOKEN, ROLE, FULL, STATIC_PAPER)
PAIRINGS = ("round_robin", "pressure")


class SimConfigError(ValueError):
    """A SimConfig field is out of range."""


@dataclass(frozen=True)
class SimConfig:
    """Immutable; validated on construction (raises SimConfigError)."""

    workers: int = 8
    prefill_workers: int = 0  # initial prefill workers; 0 = workers // 2 (4P4D for 8)
    fluidtoken: bool = False
    fluidrole: bool = False
    pairing: str = "round_robin"  # router policy: round_robin | pressure
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    # Worker engine (WorkerConfig / DecodeRole defaults).
    block_size: int = 16
    num_kv_blocks: int = 0  # per worker; 0 = the profile's capacity
    max_num_seqs: int = 64  # decode admission limit and N_TPOT cap (WorkerConfig)
    # Suffix tokens one decode iteration runs when no request decodes (DecodeRole); while
    # requests decode, the TPOT-safe chunk of pressure.suffix_chunk_tokens (as the worker).
    prefill_chunk_tokens: int = 512
    # Output tokens admission reserves beyond the prompt (WorkerConfig.decode_reserve_tokens,
    # the one formula pressure.admission_kv_tokens); longer outputs grow while decoding.
    decode_reserve_tokens: int = 256
    telemetry_interval_s: float = 0.02  # WorkerConfig.telemetry_interval_s
    # Admission (services/worker/prefill/admission.py / DecodeRole.admit): retry periods, and
    # how long a computed request may wait for decode capacity (WorkerConfig's
    # decode_wait_timeout_s) before it ends with decode_wait_timeout (failed).
    decode_wait_s: float = 60.0
    retry_batch_full_s: float = 0.02
    retry_no_blocks_s: float = 0.05
    retry_not_admitting_s: float = 0.05
    # SGLang-style abort of a request still queued for prefill this long after arrival (the
    # paper's baseline cancels after 60 s, §V-C); 0 = never (our router and workers).
    queue_timeout_s: float = 0.0
    # SLO-aware admission (shared/policy/admission.py, the live router's and prefill
    # worker's defaults): shed at the door, drop queued work past deadline + margin.
    shedding: SheddingConfig = field(default_factory=SheddingConfig)
    # KV transfer (modelling choice): one link per source worker, transfers serialised on it.
    kv_bandwidth_bytes_per_s: float = 25e9  # ~NVLink-class per-GPU bandwidth
    kv_transfer_overhead_s: float = 0.0  # fixed per transfer (envelope, validation, RTT)
    # Where an unsplit request's first token is delivered. False = the real worker: the
    # prefill worker streams it right after the prefill (TTFT excludes the KV transfer).
    # True = SGLang-style: it reaches the client with the decode side, after the transfer.
    first_token_via_decode: bool = False
    # FluidRole in the worker (switch.py): drain bound and the in-place flip itself.
    drain_timeout_s: float = 60.0
    switch_overhead_s: float = 0.05  # re-slice + route update after the drain (design goal)
    migrate_on_drain: bool = True  # D→P: move running decodes to peers (WorkerConfig.migrate)
    # Simulator bounds (speed), see telemetry.py.
    policy_queue_window: int = 256  # queued requests PPI/Algorithm 1 inspect
    sample_interval_s: float = 1.0  # time-series resolution

    def __post_init__(self) -> None:
        if not 2 <= self.workers <= 4096:
            raise SimConfigError("workers must be in [2, 4096]")
        if not 0 <= self.prefill_workers < self.workers:
            raise SimConfigError("prefill_workers must be in [0, workers)")
        if self.pairing not in PAIRINGS:
            raise SimConfigError(f"pairing must be one of {PAIRINGS}")
        ints = ("block_size", "max_num_seqs", "prefill_chunk_tokens", "policy_queue_window")
        for name in ints:
            if getattr(self, name) < 1:
                raise SimConfigError(f"{name} must be >= 1")
        if self.decode_reserve_tokens < 0:
            raise SimConfigError("decode_reserve_tokens must be >= 0")
        if self.num_kv_blocks < 0:
            raise SimConfigError("num_kv_blocks must be >= 0")
        positive = (
            "telemetry_interval_s",
            "decode_wait_s",
            "retry_batch_full_s",
            "retry_no_blocks_s",
            "retry_not_admitting_s",
            "kv_bandwidth_bytes_per_s",
            "drain_timeout_s",
            "sample_interval_s",
        )
        for name in positive:
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise SimConfigError(f"{name} must be > 0")
        for name in ("kv_transfer_overhead_s", "switch_overhead_s", "queue_timeout_s"):
            if not getattr(self, name) >= 0:
                raise SimConfigError(f"{name} must be >= 0")

    @property
    def initial_prefill(self) -> int:
        return self.prefill_workers or self.workers // 2

    @property
    def needs_telemetry(self) -> bool:
        """Telemetry only matters to pressure pairing, FluidToken and FluidRole."""
        return self.fluidtoken or self.fluidrole or self.pairing == "pressure"


def config_for(name: str, base: SimConfig | None = None) -> SimConfig:
    """The paper's configuration ``name`` (static | static-pressure | token | role | full |
    static-paper) on top of ``base`` (cluster size, SLOs, link...). Raises SimConfigError
    for an unknown name."""
    base = base or SimConfig()
    if name == STATIC:
        return replace(base, fluidtoken=False, fluidrole=False, pairing="round_robin")
    if name == STATIC_PRESSURE:
        return replace(base, fluidtoken=False, fluidrole=False, pairing="pressure")
    if name == TOKEN:
        return replace(base, fluidtoken=True, fluidrole=False, pairing="pressure")
    if name == ROLE:
        return replace(base, fluidtoken=False, fluidrole=True, pairing="pressure")
    if name == FULL:
        return replace(base, fluidtoken=True, fluidrole=True, pairing="pressure")
    if name == STATIC_PAPER:
        try:
            shedding = paper_baseline_shedding(base.policy.ttft_s)
        except PolicyConfigError as exc:
            raise SimConfigError(str(exc)) from exc
        # One abort, the baseline's: the drop past the deadline stands for SGLang's.
        return replace(config_for(STATIC, base), shedding=shedding, queue_timeout_s=0.0)
    raise SimConfigError(
        f"unknown configuration {name!r}; known: {[*CONFIGS, ORACLE, ORACLE_LIVE]}"
    )
