"""Latency predictors (FluidPD paper eq. 2, 9/16, 13) and the latency-profile JSON format.

``LatencyProfile`` holds every coefficient plus the metadata that says where they came from.
``fluidpd calibrate`` writes it with ``save``; the emulated engine, the simulator and the
policies read it with ``load``. All times are seconds (float), all lengths are tokens.

Predictor forms:

* prefill (eq. 2):  T_pre(L) = c1·L + c0.
* prefix on the prefill worker: T_pfx(L_pfx) = T_pre(L_pfx) for L_pfx > 0, and 0 when the
  whole prompt was stolen (L_pfx = 0: the prefill worker runs nothing). The paper treats the
  prefix as an ordinary shorter prefill ("each stolen token reduces the predicted prefill
  workload by c1", §IV-B3), so it has no coefficients of its own.
* stolen suffix on the decode worker: the paper writes T_sfx(L_sfx), a one-argument invertible
  predictor (eq. 9, 15, 16). A suffix is a chunked prefill on top of L_ctx = L_pfx tokens of
  transferred context, so its attention work grows with the context. We use
      T_sfx(L_sfx, L_ctx) = s0 + s1·L_sfx + s_attn·L_sfx·(L_ctx + L_sfx/2)      (L_sfx > 0)
  and T_sfx(0, ·) = 0 (nothing to run). The last term counts query·key pairs: each suffix
  token attends to the L_ctx context tokens and on average to half of the suffix before it.
  With s_attn = 0 (or L_ctx = 0 and short suffixes) this is the paper's linear form. It stays
  strictly increasing in L_sfx, hence invertible (quadratic formula, ``suffix_tokens_for``).
* decode iteration (eq. 13): T_iter(N, C) = a_C·C + a_N·N + a_0.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from shared.policy.errors import PolicyConfigError, ProfileFormatError

PROFILE_FORMAT = "fluidpd-latency-profile"
PROFILE_VERSION = 1

_SLOPES_POSITIVE = ("prefill_c1_s_per_token", "suffix_s1_s_per_token")
_SLOPES_NONNEG = (
    "suffix_attn_s_per_token_pair",
    "decode_ac_s_per_ctx_token",
    "decode_an_s_per_seq",
)
_INTERCEPTS = ("prefill_c0_s", "suffix_s0_s", "decode_a0_s")
# Every coefficient measured in seconds (per token, per pair, ...): they scale together when
# the hardware is uniformly faster or slower (time-scaled runs, exported gauges).
TIME_COEFFICIENTS = (
    "prefill_c1_s_per_token",
    "prefill_c0_s",
    "suffix_s1_s_per_token",
    "suffix_attn_s_per_token_pair",
    "suffix_s0_s",
    "decode_ac_s_per_ctx_token",
    "decode_an_s_per_seq",
    "decode_a0_s",
)


@dataclass(frozen=True, slots=True)
class LatencyProfile:
    """Predictor coefficients for one model on one hardware configuration. Immutable.

    Raises PolicyConfigError on construction when a slope is negative (or zero where the
    predictor must be invertible), a coefficient is not finite, or a size is not positive.
    Intercepts may be negative (a least-squares fit can produce a small negative c0).
    """

    model: str
    hardware: str
    prefill_c1_s_per_token: float
    prefill_c0_s: float
    suffix_s1_s_per_token: float
    suffix_attn_s_per_token_pair: float
    suffix_s0_s: float
    decode_ac_s_per_ctx_token: float
    decode_an_s_per_seq: float
    decode_a0_s: float
    kv_bytes_per_token: int
    kv_capacity_tokens: int
    max_context_tokens: int
    derivation: str = ""

    def __post_init__(self) -> None:
        for name in (*_SLOPES_POSITIVE, *_SLOPES_NONNEG, *_INTERCEPTS):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise PolicyConfigError(f"latency profile: {name} must be a finite number")
        for name in _SLOPES_POSITIVE:
            if getattr(self, name) <= 0.0:
                raise PolicyConfigError(f"latency profile: {name} must be > 0")
        for name in _SLOPES_NONNEG:
            if getattr(self, name) < 0.0:
                raise PolicyConfigError(f"latency profile: {name} must be >= 0")
        for name in ("kv_bytes_per_token", "kv_capacity_tokens", "max_context_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise PolicyConfigError(f"latency profile: {name} must be a positive int")

    def scaled(self, factor: float, note: str = "") -> LatencyProfile:
        """The same profile with every time coefficient × ``factor`` (sizes unchanged);
        ``note`` is appended to the derivation. Pure; returns ``self`` for factor 1 and
        no note. Raises PolicyConfigError for a non-positive or non-finite factor."""
        if not math.isfinite(factor) or factor <= 0:
            raise PolicyConfigError(f"latency profile: scale factor must be > 0, got {factor}")
        if factor == 1.0 and not note:
            return self
        return replace(
            self,
            derivation=self.derivation + note,
            **{name: getattr(self, name) * factor for name in TIME_COEFFICIENTS},
        )

    # ---- predictors -------------------------------------------------------------------

    def prefill_time_s(self, prompt_tokens: float) -> float:
        """Eq. 2: T_pre(L) = c1·L + c0."""
        return self.prefill_c1_s_per_token * prompt_tokens + self.prefill_c0_s

    def prefix_time_s(self, prefix_tokens: float) -> float:
        """T_pfx(L_pfx): the prefix is a shorter prefill; 0 when nothing is left (L_pfx <= 0)."""
        if prefix_tokens <= 0:
            return 0.0
        return self.prefill_c1_s_per_token * prefix_tokens + self.prefill_c0_s

    def suffix_time_s(self, suffix_tokens: float, context_tokens: float = 0.0) -> float:
        """T_sfx(L_sfx, L_ctx) (eq. 9, 15): chunked prefill of L_sfx tokens on L_ctx context."""
        if suffix_tokens <= 0:
            return 0.0
        attn_pairs = suffix_tokens * (context_tokens + 0.5 * suffix_tokens)
        return (
            self.suffix_s0_s
            + self.suffix_s1_s_per_token * suffix_tokens
            + self.suffix_attn_s_per_token_pair * attn_pairs
        )

    def suffix_tokens_for(self, time_s: float, context_tokens: float = 0.0) -> float:
        """Eq. 16: T_sfx⁻¹(time_s) — the longest suffix (tokens, not rounded) that fits.

        Returns 0 when time_s does not even cover the fixed cost s0; never more than
        ``max_context_tokens`` (a suffix cannot be longer than a prompt).
        """
        budget = time_s - self.suffix_s0_s
        if budget <= 0.0:
            return 0.0
        a = 0.5 * self.suffix_attn_s_per_token_pair
        b = self.suffix_s1_s_per_token + self.suffix_attn_s_per_token_pair * context_tokens
        if a <= 0.0:
            tokens = budget / b
        else:
            # Positive root of a·L² + b·L − budget = 0, in the cancellation-free form.
            tokens = 2.0 * budget / (b + math.sqrt(b * b + 4.0 * a * budget))
        return min(tokens, float(self.max_context_tokens))

    def decode_iter_time_s(self, batch_size: float, context_tokens: float) -> float:
        """Eq. 13: T_iter(N, C) = a_C·C + a_N·N + a_0 (C = aggregate context of the batch)."""
        return (
            self.decode_ac_s_per_ctx_token * context_tokens
            + self.decode_an_s_per_seq * batch_size
            + self.decode_a0_s
        )

    def max_tpot_batch(
        self, tpot_s: float, mean_context_tokens: float, max_batch: int | None = None
    ) -> int:
        """N_TPOT (eq. 7): largest decode batch N with T_iter(N, N·c̄) <= S_TPOT.

        c̄ = ``mean_context_tokens`` per sequence, so adding a sequence adds its context too:
        N = floor((S_TPOT − a_0) / (a_C·c̄ + a_N)). Returns 0 when even an empty batch misses
        the SLO; ``max_batch`` (e.g. the engine's max_num_seqs) caps the result, and is
        returned when the per-sequence cost is zero.
        """
        headroom = tpot_s - self.decode_a0_s
        if headroom < 0.0:
            return 0
        per_seq = self.decode_ac_s_per_ctx_token * mean_context_tokens + self.decode_an_s_per_seq
        if per_seq <= 0.0:
            return max_batch if max_batch is not None else 1 << 30
        n = math.floor(headroom / per_seq + 1e-9)
        return n if max_batch is None else min(n, max_batch)

    # ---- JSON format ------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (nested by predictor, each block naming its equation)."""
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "model": self.model,
            "hardware": self.hardware,
            "prefill": {
                "equation": "T_pre(L) = c1*L + c0  (paper eq. 2)",
                "c1_s_per_token": self.prefill_c1_s_per_token,
                "c0_s": self.prefill_c0_s,
            },
            "suffix": {
                "equation": "T_sfx(Ls, Lc) = s0 + s1*Ls + s_attn*Ls*(Lc + Ls/2), 0 if Ls = 0",
                "s1_s_per_token": self.suffix_s1_s_per_token,
                "attn_s_per_token_pair": self.suffix_attn_s_per_token_pair,
                "s0_s": self.suffix_s0_s,
            },
            "decode_iter": {
                "equation": "T_iter(N, C) = a_C*C + a_N*N + a_0  (paper eq. 13)",
                "a_c_s_per_ctx_token": self.decode_ac_s_per_ctx_token,
                "a_n_s_per_seq": self.decode_an_s_per_seq,
                "a_0_s": self.decode_a0_s,
            },
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "max_context_tokens": self.max_context_tokens,
            "derivation": self.derivation,
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> LatencyProfile:
        """Inverse of ``to_dict``. Raises ProfileFormatError on a wrong format/version or a
        missing field, PolicyConfigError on an out-of-range value."""
        if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT:
            raise ProfileFormatError(f"not a {PROFILE_FORMAT} document")
        if doc.get("version") != PROFILE_VERSION:
            raise ProfileFormatError(f"unsupported profile version {doc.get('version')!r}")
        try:
            pre, sfx, dec = doc["prefill"], doc["suffix"], doc["decode_iter"]
            return cls(
                model=str(doc["model"]),
                hardware=str(doc["hardware"]),
                prefill_c1_s_per_token=float(pre["c1_s_per_token"]),
                prefill_c0_s=float(pre["c0_s"]),
                suffix_s1_s_per_token=float(sfx["s1_s_per_token"]),
                suffix_attn_s_per_token_pair=float(sfx["attn_s_per_token_pair"]),
                suffix_s0_s=float(sfx["s0_s"]),
                decode_ac_s_per_ctx_token=float(dec["a_c_s_per_ctx_token"]),
                decode_an_s_per_seq=float(dec["a_n_s_per_seq"]),
                decode_a0_s=float(dec["a_0_s"]),
                kv_bytes_per_token=int(doc["kv_bytes_per_token"]),
                kv_capacity_tokens=int(doc["kv_capacity_tokens"]),
                max_context_tokens=int(doc["max_context_tokens"]),
                derivation=str(doc.get("derivation", "")),
            )
        except (KeyError, TypeError) as exc:
            raise ProfileFormatError(f"latency profile: missing or malformed field {exc}") from exc

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> LatencyProfile:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileFormatError(f"latency profile is not JSON: {exc}") from exc
        return cls.from_dict(doc)

    def save(self, path: str | Path) -> None:
        """Write the JSON document to ``path`` (overwrites). The only I/O in this module;
        callers in pure code use to_json/from_json instead."""
        Path(path).write_text(self.to_json() + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> LatencyProfile:
        return cls.from_json(Path(path).read_text(encoding="utf-8"))

    def as_flat_dict(self) -> dict[str, Any]:
        """Field name → value (for logs and dataclasses.replace-style tooling)."""
        return asdict(self)


def example_profile() -> LatencyProfile:
    """An illustrative profile shaped like Llama-3.1-8B on one A100 (NOT measured).

    Used by tests, the control benchmark and as a simulator default until ``fluidpd
    calibrate`` has produced a real one.
    """
    return LatencyProfile(
        model="example-llama-8b",
        hardware="illustrative-a100",
        prefill_c1_s_per_token=1.0e-4,  # ~10k prompt tokens/s
        prefill_c0_s=0.010,
        suffix_s1_s_per_token=1.1e-4,  # slightly slower than on the prefill worker
        suffix_attn_s_per_token_pair=2.0e-9,
        suffix_s0_s=0.005,
        decode_ac_s_per_ctx_token=1.0e-7,
        decode_an_s_per_seq=2.0e-4,
        decode_a0_s=0.012,
        kv_bytes_per_token=131072,
        kv_capacity_tokens=400_000,
        max_context_tokens=32_768,
        derivation="illustrative numbers for tests and benchmarks; not measured",
    )
