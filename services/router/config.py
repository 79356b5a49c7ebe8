"""The router's one frozen config. Built by ``__main__`` from flags and environment."""

from __future__ import annotations

import math
import os
import re
import socket
from dataclasses import dataclass, field

from shared.bus.config import BusConfig
from shared.policy.admission import (
    DEFAULT_DECODE_BACKLOG_BATCHES,
    DEFAULT_EXPIRE_MARGIN_S,
    DEFAULT_TTFT_MULTIPLE,
    STREAM_HOLD_SLACK_S,
    SheddingConfig,
)
from shared.policy.errors import PolicyConfigError

PAIRING_POLICIES = ("pressure", "round_robin")
_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
# The automatic stream-header hold: the TTFT SLO plus this (15 s). It covers the prefill
# worker's default --expire-margin-s and the slack for the drop to be noticed (a worker
# checks expiry when it takes its next prompt) and to travel back.
STREAM_HOLD_AUTO_MARGIN_S = DEFAULT_EXPIRE_MARGIN_S + STREAM_HOLD_SLACK_S


def default_router_id() -> str:
    """``router-<short hostname>-<pid>``, with characters NATS ids do not allow replaced."""
    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname().split(".")[0]) or "host"
    return f"router-{host}-{os.getpid()}"[:128]


@dataclass(frozen=True)
class RouterConfig:
    """Everything a router process needs before it starts. Validated on creation.

    ``short_prompt_tokens``: prompts of at most this many tokens skip the prefill worker and
    go whole to the decode worker (0 disables). ``ttft_slo_ms`` sets each request's TTFT
    deadline. ``request_timeout_s`` bounds a whole request; ``submit_timeout_s`` bounds the
    PrefillRequest round trip (one try).
    """

    id: str = field(default_factory=default_router_id)
    host: str = "127.0.0.1"
    port: int = 8000
    # How to reach NATS (services/common/bus_flags.py makes it from the --nats* flags); the
    # router names the connection after its id.
    bus: BusConfig = field(default_factory=BusConfig)
    api_key: str = field(default="", repr=False)  # "": the OpenAI routes are open
    subject_prefix: str = "fluidpd"
    model: str = "smollm2-135m"
    served_model_name: str = ""
    pairing: str = "pressure"
    short_prompt_tokens: int = 0
    ttft_slo_ms: float = 2000.0
    request_timeout_s: float = 600.0
    submit_timeout_s: float = 5.0
    registry_timeout_s: float = 10.0
    telemetry_stale_s: float = 1.0
    # Shed (503 + Retry-After) when the predicted TTFT exceeds this multiple of the TTFT SLO
    # (services/router/admission.py); 0 turns shedding off.
    shed_ttft_multiple: float = DEFAULT_TTFT_MULTIPLE
    # ... and when every decode worker has this many batches (× max_num_seqs) of requests
    # waiting for decode admission; 0 turns it off.
    shed_decode_backlog: float = DEFAULT_DECODE_BACKLOG_BATCHES
    stream_header_hold_s: float | None = None
    log_json: bool = False

    def __post_init__(self) -> None:
        if not _ID_RE.match(self.id):
            raise ValueError(f"router id must be letters, digits, '_' or '-', got {self.id!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not self.model:
            raise ValueError("model is required")
        if self.pairing not in PAIRING_POLICIES:
            raise ValueError(f"pairing must be one of {PAIRING_POLICIES}, got {self.pairing!r}")
        if self.short_prompt_tokens < 0:
            raise ValueError("short_prompt_tokens must be >= 0")
        try:  # SheddingConfig owns the rules of both knobs (the simulator's too)
            self.shedding  # noqa: B018
        except PolicyConfigError as exc:
            raise ValueError(
                f"shed_ttft_multiple={self.shed_ttft_multiple}, "
                f"shed_decode_backlog={self.shed_decode_backlog}: {exc}"
            ) from None
        hold = self.stream_header_hold_s
        if hold is not None and not (math.isfinite(hold) and hold >= 0.0):
            raise ValueError(
                f"stream_header_hold_s must be a finite number >= 0 (0: off), got {hold}"
            )
        for name in (
            "ttft_slo_ms",
            "request_timeout_s",
            "submit_timeout_s",
            "registry_timeout_s",
            "telemetry_stale_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")

    @property
    def header_hold_s(self) -> float:
        """Seconds a stream's headers wait for its first token before they go out anyway:
        the configured value, or the TTFT SLO + STREAM_HOLD_AUTO_MARGIN_S. Pure."""
        if self.stream_header_hold_s is not None:
            return self.stream_header_hold_s
        return self.ttft_slo_ms / 1000.0 + STREAM_HOLD_AUTO_MARGIN_S

    @property
    def shedding(self) -> SheddingConfig:
        """The admission gate's rules (services/router/admission.py): the two shedding
        knobs; expiry is the prefill workers' (no margin here). Pure."""
        return SheddingConfig(
            ttft_multiple=self.shed_ttft_multiple,
            expire_margin_s=None,
            decode_backlog_batches=self.shed_decode_backlog,
        )

    @property
    def model_name(self) -> str:
        """The name clients must send as ``model`` (and /v1/models lists)."""
        return self.served_model_name or self.model
