"""Fitting the latency predictors offline: ordinary least squares with bounds.

Offline (``fluidpd calibrate``): ``fit_prefill``/``fit_suffix``/``fit_decode`` run ordinary
least squares on measured samples, with lower bounds on the slopes (a fitted negative slope
is pinned to its bound and the rest refitted), and ``fit_profile`` builds a LatencyProfile.

Online recalibration (EWLinearEstimator, OnlineRecalibrator) lives in recalibration.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from shared.policy.errors import PolicyConfigError
from shared.policy.predictors import LatencyProfile


def solve_linear_system(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting (small dense systems). None if singular.
    Mutates its arguments (callers pass fresh copies)."""
    n = len(rhs)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(matrix[r][col]))
        if abs(matrix[pivot][col]) < 1e-300:
            return None
        if pivot != col:
            matrix[col], matrix[pivot] = matrix[pivot], matrix[col]
            rhs[col], rhs[pivot] = rhs[pivot], rhs[col]
        inv = 1.0 / matrix[col][col]
        for r in range(col + 1, n):
            f = matrix[r][col] * inv
            if f != 0.0:
                row_r, row_c = matrix[r], matrix[col]
                for c in range(col, n):
                    row_r[c] -= f * row_c[c]
                rhs[r] -= f * rhs[col]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        acc = rhs[r] - sum(matrix[r][c] * out[c] for c in range(r + 1, n))
        out[r] = acc / matrix[r][r]
    return out


def fit_linear(
    rows: Sequence[Sequence[float]],
    targets: Sequence[float],
    lower_bounds: Sequence[float | None] | None = None,
) -> tuple[float, ...]:
    """Ordinary least squares θ = argmin Σ (y − θ·x)², with optional lower bounds.

    A coefficient that comes out below its bound is pinned there and the others are refitted
    (repeated until none is violated). Raises PolicyConfigError when there are fewer samples
    than coefficients or the system is singular (e.g. every sample has the same x).
    """
    if not rows or len(rows) != len(targets):
        raise PolicyConfigError("fit_linear: need as many targets as rows, at least one")
    dim = len(rows[0])
    bounds = list(lower_bounds) if lower_bounds is not None else [None] * dim
    pinned: dict[int, float] = {}
    while True:
        free = [j for j in range(dim) if j not in pinned]
        if len(rows) < len(free):
            raise PolicyConfigError(f"fit_linear: {len(rows)} samples for {len(free)} unknowns")
        # Column scaling keeps the normal equations well conditioned (tokens vs. constants).
        scale = [max((abs(r[j]) for r in rows), default=1.0) or 1.0 for j in free]
        ata = [[0.0] * len(free) for _ in free]
        aty = [0.0] * len(free)
        for row, y in zip(rows, targets, strict=True):
            resid = y - sum(row[j] * v for j, v in pinned.items())
            z = [row[j] / s for j, s in zip(free, scale, strict=True)]
            for a, za in enumerate(z):
                aty[a] += za * resid
                for b in range(a, len(z)):
                    ata[a][b] += za * z[b]
        for a in range(len(free)):
            for b in range(a):
                ata[a][b] = ata[b][a]
        sol = solve_linear_system(ata, aty)
        if sol is None:
            raise PolicyConfigError("fit_linear: singular system (samples do not vary enough)")
        theta = dict(pinned)
        for j, s, v in zip(free, scale, sol, strict=True):
            theta[j] = v / s
        violated = [j for j in free if bounds[j] is not None and theta[j] < bounds[j]]  # type: ignore[operator]
        if not violated:
            return tuple(theta[j] for j in range(dim))
        for j in violated:
            pinned[j] = float(bounds[j])  # type: ignore[arg-type]


MIN_SLOPE = 1e-12  # keeps c1 and s1 strictly positive (eq. 19 divides by c1; eq. 16 inverts)


def prefill_features(prompt_tokens: float) -> tuple[float, float]:
    return (float(prompt_tokens), 1.0)


def suffix_features(suffix_tokens: float, context_tokens: float) -> tuple[float, float, float]:
    return (float(suffix_tokens), suffix_tokens * (context_tokens + 0.5 * suffix_tokens), 1.0)


def decode_features(batch_size: float, context_tokens: float) -> tuple[float, float, float]:
    return (float(context_tokens), float(batch_size), 1.0)


def fit_prefill(samples: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """(prompt_tokens, seconds) samples → (c1, c0) of eq. 2."""
    pts = list(samples)
    c1, c0 = fit_linear(
        [prefill_features(n) for n, _ in pts], [t for _, t in pts], [MIN_SLOPE, None]
    )
    return c1, c0


def fit_suffix(samples: Iterable[tuple[float, float, float]]) -> tuple[float, float, float]:
    """(suffix_tokens, context_tokens, seconds) samples → (s1, s_attn, s0)."""
    pts = list(samples)
    rows = [suffix_features(s, c) for s, c, _ in pts]
    s1, sa, s0 = fit_linear(rows, [t for *_, t in pts], [MIN_SLOPE, 0.0, None])
    return s1, sa, s0


def fit_decode(samples: Iterable[tuple[float, float, float]]) -> tuple[float, float, float]:
    """(batch_size N, context_tokens C, seconds) samples → (a_C, a_N, a_0) of eq. 13."""
    pts = list(samples)
    rows = [decode_features(n, c) for n, c, _ in pts]
    ac, an, a0 = fit_linear(rows, [t for *_, t in pts], [0.0, 0.0, None])
    return ac, an, a0


def mean_relative_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """MRE = mean |pred − meas| / meas (the paper's Fig. 13 metric). Skips meas <= 0."""
    errs = [abs(p - m) / m for p, m in zip(predicted, measured, strict=True) if m > 0]
    return sum(errs) / len(errs) if errs else 0.0


def fit_profile(
    base: LatencyProfile,
    prefill_samples: Iterable[tuple[float, float]],
    suffix_samples: Iterable[tuple[float, float, float]],
    decode_samples: Iterable[tuple[float, float, float]],
    derivation: str,
) -> LatencyProfile:
    """A new profile with every predictor fitted by OLS (metadata taken from ``base``)."""
    c1, c0 = fit_prefill(prefill_samples)
    s1, sa, s0 = fit_suffix(suffix_samples)
    ac, an, a0 = fit_decode(decode_samples)
    return replace(
        base,
        prefill_c1_s_per_token=c1,
        prefill_c0_s=c0,
        suffix_s1_s_per_token=s1,
        suffix_attn_s_per_token_pair=sa,
        suffix_s0_s=s0,
        decode_ac_s_per_ctx_token=ac,
        decode_an_s_per_seq=an,
        decode_a0_s=a0,
        derivation=derivation,
    )
