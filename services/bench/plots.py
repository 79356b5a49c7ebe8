"""Figures of docs/results.md from the JSON the benchmarks write (matplotlib, Agg, PNG).

``python -m services.bench.plots attainment --input A.json [B.json ...] --out F.png``
    The paper's Fig. 9a: joint (and TTFT, TPOT) SLO attainment vs RPS, one line per
    configuration, one column per input. An input is the last stdout line of
    ``fluidpd bench sim`` or ``fluidpd bench replay`` (``results[config][rps]``).
``python -m services.bench.plots timeseries --input STATIC.json FULL.json --out F.png``
    Fig. 10: p95 TTFT, prefill queue, prefill workers and stolen tokens/s over (trace) time;
    an input is a per-run file (``bench sim --out``: ``<workload>_<config>_rps<R>.json``;
    ``bench replay``: ``run-<config>-<rps>.json``).
``python -m services.bench.plots ablation --input A.json [B.json ...] --rps R [R ...]``
    Fig. 11: joint attainment of static/token/role/full at one RPS per input.

Reads files only; writes the PNG (parent directory created). Raises SystemExit on inputs
that lack what a figure needs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt

ORDER = ("static", "token", "role", "full", "oracle", "external")
STYLE = {
    "static": ("tab:gray", "o", "static 4P4D"),
    "token": ("tab:blue", "s", "FluidToken only"),
    "role": ("tab:orange", "^", "FluidRole only"),
    "full": ("tab:red", "D", "FluidPD (full)"),
    "oracle": ("black", "x", "oracle (best static per window)"),
    "external": ("tab:green", "v", "external"),
}
METRICS = (
    ("joint_attainment", "joint SLO attainment"),
    ("ttft_attainment", "TTFT attainment"),
    ("tpot_attainment", "TPOT attainment"),
)


def load_json(path: str) -> dict[str, Any]:
    """A JSON file, or the last non-empty line of a benchmark's stdout capture."""
    text = Path(path).read_text(encoding="utf-8").strip()
    try:
        return dict(json.loads(text))
    except json.JSONDecodeError:
        return dict(json.loads(text.splitlines()[-1]))


def _title(doc: dict[str, Any], path: str) -> str:
    name = doc.get("workload", Path(path).stem)
    workers = doc.get("workers")
    kind = doc.get("bench", "")
    return f"{name} ({kind}, {workers} workers)" if workers else str(name)


def plot_attainment(inputs: list[str], out: str) -> None:
    docs = [load_json(p) for p in inputs]
    fig, axes = plt.subplots(
        len(METRICS), len(docs), figsize=(5.2 * len(docs), 3.2 * len(METRICS)), squeeze=False
    )
    for col, (doc, path) in enumerate(zip(docs, inputs, strict=True)):
        results = doc.get("results")
        if not results:
            raise SystemExit(f"{path}: no 'results' (not a bench summary)")
        for row, (key, label) in enumerate(METRICS):
            ax = axes[row][col]
            for cfg in [c for c in ORDER if c in results]:
                pts = sorted((float(r), v[key]) for r, v in results[cfg].items() if key in v)
                color, marker, name = STYLE[cfg]
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    color=color,
                    marker=marker,
                    label=name,
                    linestyle="--" if cfg == "oracle" else "-",
                )
            ax.set_ylim(-0.02, 1.02)
            ax.set_xlabel("offered load (requests/s)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(_title(doc, path))
    axes[0][0].legend(fontsize=8, loc="lower left")
    _save(fig, out)


def _switch_lines(ax: Any, doc: dict[str, Any]) -> None:
    for sw in doc.get("switch_log", []):
        if not sw.get("cancelled"):
            ax.axvline(sw["t_s"], color="tab:red", alpha=0.25, linewidth=0.8)


def plot_timeseries(inputs: list[str], out: str, title: str = "") -> None:
    docs = [load_json(p) for p in inputs]
    panels = (
        ("p95 TTFT (ms, by arrival s)", None),
        ("prefill queue (requests)", "prefill_queue"),
        ("prefill workers", "prefill_workers"),
        ("stolen tokens/s", "stolen_tokens_per_s"),
    )
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 9), sharex=True)
    for doc, path in zip(docs, inputs, strict=True):
        cfg = doc.get("config") or doc.get("label") or Path(path).stem
        color, _, name = STYLE.get(cfg, ("tab:purple", "", cfg))
        series = doc.get("series") or {}
        p95 = series.get("p95_ttft_ms_by_arrival_s") or {}
        if not p95 or "t_s" not in series:
            raise SystemExit(f"{path}: no time series (need a per-run file)")
        # A failed request (no first token) counts as an infinite TTFT: clip to the top.
        cap = max([v for v in p95["p95_ttft_ms"] if v is not None] or [1.0]) * 1.05
        ttft = [cap if v is None else v for v in p95["p95_ttft_ms"]]
        axes[0].plot(p95["t_s"], ttft, color=color, label=name, linewidth=0.9)
        for ax, (_, key) in zip(axes[1:], panels[1:], strict=True):
            ax.plot(series["t_s"], series.get(key, []), color=color, label=name, linewidth=0.9)
        if cfg == "full":
            for ax in axes:
                _switch_lines(ax, doc)
    for label, t0 in (docs[0].get("stage_starts_s") or {}).items():
        if t0 > 0:  # a new stage of azure-staged begins (bench sim per-run files)
            for ax in axes:
                ax.axvline(t0, color="black", linestyle="--", linewidth=0.9, alpha=0.7)
            axes[-1].annotate(label, (t0, 0), fontsize=7, xytext=(2, 2), textcoords="offset points")
    slo = docs[0].get("summary", {}).get("slo_ttft_ms")
    axes[0].axhline(slo or 2000.0, color="black", linestyle=":", linewidth=0.8, label="TTFT SLO")
    axes[0].set_yscale("log")
    for ax, (label, _) in zip(axes, panels, strict=True):
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("trace time (s)")
    axes[0].legend(fontsize=8, loc="upper left")
    axes[0].set_title(title or "time series (vertical lines: FluidRole switches of 'full')")
    _save(fig, out)


def plot_ablation(inputs: list[str], rates: list[str], out: str) -> None:
    docs = [load_json(p) for p in inputs]
    if len(rates) != len(docs):
        raise SystemExit("give one --rps per input")
    cfgs = ("static", "token", "role", "full")
    fig, ax = plt.subplots(figsize=(4.5 * len(docs), 3.6))
    width = 0.8 / len(cfgs)
    for i, cfg in enumerate(cfgs):
        vals = []
        for doc, rps, path in zip(docs, rates, inputs, strict=True):
            row = doc.get("results", {}).get(cfg, {}).get(rps)
            if row is None:
                raise SystemExit(f"{path}: no {cfg} result at rps {rps}")
            vals.append(row["joint_attainment"])
        xs = [j + (i - 1.5) * width for j in range(len(docs))]
        color, _, name = STYLE[cfg]
        bars = ax.bar(xs, vals, width, color=color, label=name)
        ax.bar_label(bars, labels=[f"{v:.2f}" for v in vals], fontsize=7)
    ax.set_xticks(range(len(docs)))
    ax.set_xticklabels(
        [f"{_title(d, p)}\n@ {r} rps" for d, p, r in zip(docs, inputs, rates, strict=True)],
        fontsize=8,
    )
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("joint SLO attainment")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    _save(fig, out)


def _save(fig: Any, out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m services.bench.plots", description=__doc__.split("\n")[0]
    )
    sub = ap.add_subparsers(dest="figure", required=True)
    for name in ("attainment", "timeseries", "ablation"):
        p = sub.add_parser(name)
        p.add_argument("--input", nargs="+", required=True)
        p.add_argument("--out", required=True)
        if name == "ablation":
            p.add_argument("--rps", nargs="+", required=True, help="one rate per input")
        if name == "timeseries":
            p.add_argument("--title", default="")
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    if a.figure == "attainment":
        plot_attainment(a.input, a.out)
    elif a.figure == "timeseries":
        plot_timeseries(a.input, a.out, a.title)
    else:
        plot_ablation(a.input, a.rps, a.out)
    print(json.dumps({"figure": a.figure, "out": a.out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
