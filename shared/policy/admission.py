"""SLO-aware admission (goodput): shed a request at the door when its predicted TTFT is
hopeless, and drop queued work whose deadline passed long ago.

Not in the paper (its SGLang baseline only aborts after 60 s); ours because at overload the
backlog of requests that can no longer meet their TTFT is otherwise served anyway and
poisons every later window. The router, the prefill worker and the simulator call these
same functions. Pure; times in seconds, lengths in tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from shared.policy.errors import PolicyConfigError
from shared.policy.predictors import LatencyProfile

# The one default, read by the router's config and flag too. 1: a request predicted to miss
# its TTFT SLO is rejected (goodput). Under sustained overload the door keeps the predicted
# queue wait just under multiple x S_TTFT, so with any multiple above 1 nearly every admitted
# request misses its SLO while it holds the capacity the next ones need: at 2 (the value
# before session 10) the simulator's static 4P4D reached 0.58-0.72 joint attainment on the
# 25 rps cross-check slices, at 1 it reaches 0.95-0.98, and every configuration gains at
# every rate swept (docs/results.md, "Shedding at the SLO").
DEFAULT_TTFT_MULTIPLE = 1.0
# Queued prefill work is dropped this long past its TTFT deadline: the one default of the
# prefill worker's --expire-margin-s, the replay bench and the simulator. 5 s: such a request
# has missed its SLO by 3.5x S_TTFT (2 s) already, and computing it delays every request
# queued behind it; the robustness sweep (docs/results.md) is measured at this value.
DEFAULT_EXPIRE_MARGIN_S = 5.0
# A streamed response's headers wait this much past TTFT deadline + expiry margin: a drop is
# noticed only when the prefill worker takes its next prompt, then travels back. The one
# value of the router's automatic --stream-header-hold-s (S_TTFT + DEFAULT_EXPIRE_MARGIN_S +
# this) and of the hold bench replay gives its routers (in trace seconds).
STREAM_HOLD_SLACK_S = 10.0
# The router sheds when every Active decode worker already has this many batches
# (x its max_num_seqs) of requests waiting for decode admission: the one default of the
# router's --shed-decode-backlog, the replay bench and the simulator. A newcomer behind b
# batches waits ~b decode lifetimes for a slot after its first token, so it misses its TPOT
# SLO while its prefill took capacity. 0.5 (1 before session 11): in the simulator `full`
# gained +0.65 pp mean joint attainment on 48 dev cells and +1.1 pp on 24 held-out cells
# (35-130 rps; per cell -3.9 ... +8.2 pp), the static splits are unchanged (their decode side
# does not back up), 0.25 and 0.1 gained less (docs/results.md, Session 11).
DEFAULT_DECODE_BACKLOG_BATCHES = 0.5
# The paper's baseline (SGLang, §V-C) has no door and aborts a request still queued this
# long after its arrival: the ``static-paper`` configuration of bench sim / sim-sweep /
# replay (``paper_baseline_shedding``).
PAPER_ABORT_AFTER_S = 60.0


@dataclass(frozen=True, slots=True)
class SheddingConfig:
    """``ttft_multiple``: shed when predicted TTFT > multiple × S_TTFT (0 = never shed at the
    door). ``expire_margin_s``: a queued prefill is dropped once its TTFT deadline has passed
    by this much (None = never drop). ``decode_backlog_batches``: shed when every Active
    decode worker has this many batches of requests waiting for admission (0 = never;
    ``sheds_for_decode_backlog``)."""

    ttft_multiple: float = DEFAULT_TTFT_MULTIPLE
    expire_margin_s: float | None = DEFAULT_EXPIRE_MARGIN_S
    decode_backlog_batches: float = DEFAULT_DECODE_BACKLOG_BATCHES

    def __post_init__(self) -> None:
        if not (self.ttft_multiple == 0.0 or self.ttft_multiple >= 1.0) or math.isnan(
            self.ttft_multiple
        ):
            raise PolicyConfigError("SheddingConfig: ttft_multiple must be 0 (off) or >= 1")
        if self.expire_margin_s is not None and not self.expire_margin_s >= 0.0:
            raise PolicyConfigError("SheddingConfig: expire_margin_s must be >= 0 or None")
        if not self.decode_backlog_batches >= 0.0 or math.isinf(self.decode_backlog_batches):
            raise PolicyConfigError(
                "SheddingConfig: decode_backlog_batches must be a finite number >= 0 (0: off)"
            )

    @property
    def sheds(self) -> bool:
        return self.ttft_multiple > 0.0


def queue_work_s(
    queued_prompt_tokens: Iterable[int],
    profile: LatencyProfile,
    *,
    running_remaining_s: float = 0.0,
) -> float:
    """Predicted seconds of prefill work ahead of a newcomer: Σ T_pre(L_k) over the queue
    (eq. 2, the numerator of eq. 3) plus what remains of the running prefill."""
    c1, c0 = profile.prefill_c1_s_per_token, profile.prefill_c0_s
    total = running_remaining_s
    for tokens in queued_prompt_tokens:
        total += c1 * tokens + c0
    return total


def predicted_ttft_s(queue_ahead_s: float, prompt_tokens: int, profile: LatencyProfile) -> float:
    """TTFT a newcomer would see on a prefill worker: the work queued ahead of it plus its
    own T_pre(L) (eq. 2)."""
    return queue_ahead_s + profile.prefill_time_s(prompt_tokens)


def should_shed(predicted_s: float, ttft_slo_s: float, cfg: SheddingConfig) -> bool:
    """True when the request should be rejected before anything is computed for it."""
    return cfg.sheds and predicted_s > cfg.ttft_multiple * ttft_slo_s


def retry_after_s(predicted_s: float, ttft_slo_s: float, cfg: SheddingConfig) -> int:
    """Whole seconds (>= 1) after which the queue ahead should have drained below the
    shedding threshold: the value of an HTTP ``Retry-After`` header."""
    excess_s = predicted_s - cfg.ttft_multiple * ttft_slo_s
    return max(1, math.ceil(excess_s))


def least_decode_backlog_batches(waiting_and_slots: Iterable[tuple[float, int]]) -> float | None:
    """The decode backlog the door sheds on: the least ``waiting / slots`` (requests waiting
    for admission over the batch limit, ``max_num_seqs``, read as at least 1) over the
    given decode workers; None when none is given. The router, the simulator and FluidRole
    (cluster_view.decode_waiting_batches) read it through this one function."""
    return min((waiting / max(1, slots) for waiting, slots in waiting_and_slots), default=None)


def sheds_for_decode_backlog(backlog_batches: float | None, cfg: SheddingConfig) -> bool:
    """True when a newcomer should be rejected because the smallest decode backlog over the
    Active decode workers (requests waiting for admission / max_num_seqs; None = unknown)
    reached ``cfg.decode_backlog_batches``: it would wait at least that many batch
    turnovers for a decode slot."""
    return (
        cfg.decode_backlog_batches > 0
        and backlog_batches is not None
        and backlog_batches >= cfg.decode_backlog_batches
    )


def is_expired(deadline_s: float, now_s: float, cfg: SheddingConfig) -> bool:
    """True when queued work whose TTFT deadline is ``deadline_s`` should be dropped."""
    return cfg.expire_margin_s is not None and now_s > deadline_s + cfg.expire_margin_s


def paper_baseline_shedding(ttft_slo_s: float) -> SheddingConfig:
    """The paper's baseline admission: nothing shed at the door, and queued prefill work
    dropped ``PAPER_ABORT_AFTER_S`` after arrival, i.e. past its TTFT deadline (arrival +
    ``ttft_slo_s``) by the rest. Raises PolicyConfigError if ``ttft_slo_s`` is not in
    (0, PAPER_ABORT_AFTER_S]."""
    if not 0.0 < ttft_slo_s <= PAPER_ABORT_AFTER_S:
        raise PolicyConfigError(
            f"paper baseline: the TTFT SLO must be in (0, {PAPER_ABORT_AFTER_S:g}] s"
        )
    return SheddingConfig(
        ttft_multiple=0.0,
        expire_margin_s=PAPER_ABORT_AFTER_S - ttft_slo_s,
        decode_backlog_batches=0.0,
    )
