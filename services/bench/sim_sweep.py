"""``fluidpd bench sim-sweep``: the robustness sweep — every workload × arrival seed × trace
offset × RPS on the simulated cluster, ``full`` against the per-window ``oracle`` and the
static baselines, judged separately on the cells the policy was tuned on and on held-out ones.

A cell is one (workload, seed, offset, rps); in it every configuration replays the same
trace (Poisson arrivals from ``seed``, the traces read from ``offset`` seconds). Per
(workload, rps) it reports min / median of full − oracle, full − static,
full − static-pressure and full − static-paper (the paper's own baseline: no door, queued
work aborted 60 s after arrival; percentage points of joint attainment, and the cells where
full is 30 pp or more above it) and whether the goals hold:
full >= oracle − 3 pp in every cell, and full >= oracle in every cell where the oracle is
below 0.5. A cell is *tuned* when its seed is in ``--tune-seeds`` and its offset in
``--tune-offsets``; everything else is held out. The LAST stdout line is one JSON object::

    {"bench": "sim-sweep", "cells": n, "goals": {"tuned": {...}, "held_out": {...}},
     "by_rps": {"<workload>": {"<rps>": {"full_minus_oracle_pp": {"min":, "median":},
                "full_minus_static_pp": {...}, "full_minus_static_pressure_pp": {...},
                "full_minus_static_paper_pp": {...}, "cells_full_ge_static_paper_plus_30pp": n,
                "oracle_min":, "goal_cells_failed": n, "cells": n}}}, ...}

``--jobs 2`` runs two cells at once (at most 2: the machines this runs on are shared).
``--out FILE`` writes one JSON line per cell. Human-readable lines go to stderr.
``--configs full --reuse FILE`` re-runs only ``full`` and takes the other configurations of
each cell from an earlier ``--out`` file (the same workload, seed, offset, rps and request
count; the simulator is deterministic, so a configuration whose code did not change gives
the same row): a policy change to FluidRole is judged at a fraction of the
cost. The ``oracle`` and ``oracle-live`` rows also carry ``prefill_workers`` (window -> the
split), so ``--configs oracle-live --reuse FILE`` follows the stored oracle splits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.bench.config_list import config_names
from services.bench.sim import add_cluster_args, base_config

# The verdict over the cells; importable from here too.
from services.bench.sweep_summary import HOPELESS as HOPELESS
from services.bench.sweep_summary import SLACK_PP as SLACK_PP
from services.bench.sweep_summary import cell_goal_ok as cell_goal_ok
from services.bench.sweep_summary import summarize as summarize
from services.bench.workloads import MIXED, POISSON, STAGED, WORKLOADS, build_workload
from services.cli.run_command import run_command
from services.sim.config import (
    FULL,
    ORACLE,
    ORACLE_LIVE,
    STATIC,
    STATIC_PAPER,
    STATIC_PRESSURE,
    SimConfig,
)
from services.sim.oracle_live import SCHEDULE_NOTE, schedule_from_json, schedule_json
from services.sim.run import oracle_schedule, run_config
from shared.engine.profiles import load_profile

DEFAULT_RPS = {STAGED: "20,25,30,35", MIXED: "10,15,20,25"}
CONFIGS = (FULL, ORACLE, STATIC, STATIC_PRESSURE, STATIC_PAPER)
# Run only when --configs names them (services/sim/oracle_live.py: a yardstick that follows
# the cell's oracle splits; it runs the oracle again only when the row lacks them).
EXTRA = (ORACLE_LIVE,)
# The oracle's row keeps the split it chose per window ({"<window>": prefill workers}); the
# oracle-live row, the schedule it followed.
SPLITS = "prefill_workers"


@dataclass(frozen=True)
class Cell:
    workload: str
    seed: int
    offset_s: float
    rps: float
    tuned: bool
    requests: int | None = None  # truncation of the workload (None: all of it)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="fluidpd bench sim-sweep", description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default=f"{STAGED},{MIXED}")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="Poisson arrival seeds")
    ap.add_argument("--offsets", default="0,600,1200", help="trace offsets, seconds")
    ap.add_argument("--rps-staged", default=DEFAULT_RPS[STAGED])
    ap.add_argument("--rps-mixed", default=DEFAULT_RPS[MIXED])
    ap.add_argument("--tune-seeds", default="0,1", help="seeds the policy was tuned on")
    ap.add_argument("--tune-offsets", default="0", help="offsets the policy was tuned on")
    ap.add_argument(
        "--requests-staged", type=int, default=None, help="truncate azure-staged (3 stages)"
    )
    ap.add_argument("--requests-mixed", type=int, default=None, help="truncate azure-mixed")
    ap.add_argument("--jobs", type=int, default=1, help="parallel cells, 1 or 2")
    ap.add_argument("--out", default="", help="JSON lines file, one line per cell")
    ap.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"configurations to run (of {','.join(CONFIGS)}; also {','.join(EXTRA)}, only "
        "when named); the others come from --reuse",
    )
    ap.add_argument(
        "--reuse",
        default="",
        help="JSON lines file of an earlier sweep: the configurations not in --configs are "
        "taken from its matching cells (a cell it lacks runs every configuration)",
    )
    ap.add_argument(
        "--summarize",
        default="",
        help="run nothing: summarize the cells of this JSON lines file (a finished or partial "
        "--out of an earlier sweep)",
    )
    add_cluster_args(ap)
    a = ap.parse_args(argv)
    if a.jobs not in (1, 2):
        ap.error("--jobs must be 1 or 2")
    try:
        configs = config_names(a.configs, CONFIGS, EXTRA)
    except ValueError as exc:
        ap.error(f"--configs: {exc}")
    if not set(CONFIGS) <= set(configs) and not a.reuse and not a.summarize:
        ap.error("--configs with fewer than all configurations needs --reuse FILE")
    a.configs = tuple(c for c in (*CONFIGS, *EXTRA) if c in configs)
    return a


# What identifies a cell's trace: workload, seed, offset, rps and request count.
CellKey = tuple[str, int, float, float, int]


def _trace_head(
    workload: str, seed: int, offset_s: float, rps: float
) -> tuple[str, int, float, float]:
    """A cell's trace before its request count is known (the first four of a CellKey)."""
    return (workload, int(seed), float(offset_s), float(rps))


def cell_key(row: dict[str, Any]) -> CellKey:
    """What identifies a cell's trace in an --out row."""
    head = _trace_head(row["workload"], row["seed"], row["offset_s"], row["rps"])
    return (*head, int(row["requests"]))


def reused_for(cell: Cell, reused: dict[CellKey, dict[str, Any]]) -> dict[CellKey, dict[str, Any]]:
    """The rows of ``reused`` that can belong to ``cell`` (all but the request count match:
    that is known once the trace is built). Handed to a pool worker instead of the whole
    file's rows, which would be pickled once per cell."""
    head = _trace_head(cell.workload, cell.seed, cell.offset_s, cell.rps)
    return {k: v for k, v in reused.items() if k[:4] == head}


def load_rows(path: str) -> list[dict[str, Any]]:
    """The rows of a JSON lines --out file. Raises OSError / ValueError on a bad file."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _floats(text: str) -> list[float]:
    """``"0,600"`` -> ``[0.0, 600.0]``. Raises ValueError naming the text."""
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"not a comma-separated list of numbers: {text!r}") from None


def cells_of(args: argparse.Namespace) -> list[Cell]:
    """Every cell of the sweep, in a fixed order. Raises SystemExit on an unknown workload."""
    tune_seeds = {int(s) for s in _floats(args.tune_seeds)}
    tune_offsets = set(_floats(args.tune_offsets))
    out: list[Cell] = []
    for workload in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        if workload not in WORKLOADS:
            raise SystemExit(f"unknown workload {workload!r}; known: {list(WORKLOADS)}")
        rates = _floats(args.rps_staged if workload == STAGED else args.rps_mixed)
        # Seed-major: a sweep cut short still covers every offset of the seeds it reached.
        for seed in [int(s) for s in _floats(args.seeds)]:
            for offset in _floats(args.offsets):
                tuned = seed in tune_seeds and offset in tune_offsets
                requests = args.requests_staged if workload == STAGED else args.requests_mixed
                out.extend(Cell(workload, seed, offset, rps, tuned, requests) for rps in rates)
    return out


def run_cell(
    cell: Cell,
    base: SimConfig,
    profile_name: str,
    configs: tuple[str, ...] = CONFIGS,
    reused: dict[CellKey, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """``configs`` on one cell's trace (joint attainment and counters per config); the other
    configurations are copied from the ``reused`` row of the same cell, or run when it has
    none (or lacks that configuration: rows written before ``static-paper`` existed)."""
    profile = load_profile(profile_name)
    trace = build_workload(
        cell.workload,
        rps=cell.rps,
        requests=cell.requests,
        trace_offset_s=cell.offset_s,
        arrival=POISSON,
        seed=cell.seed,
    )
    ttft_s, tpot_s = base.policy.ttft_s, base.policy.tpot_s
    row: dict[str, Any] = {
        "workload": cell.workload,
        "seed": cell.seed,
        "offset_s": cell.offset_s,
        "rps": cell.rps,
        "tuned": cell.tuned,
        "requests": len(trace),
    }
    old = (reused or {}).get(cell_key(row))
    schedule = None  # this cell's oracle splits, once known (oracle-live follows them)
    for name in (*CONFIGS, *EXTRA):
        if old is not None and name not in configs and name in old:
            row[name] = old[name]
            if name == ORACLE and SPLITS in old[name]:  # rows written before Session 22 lack it
                schedule = schedule_from_json(old[name][SPLITS])
            continue
        if name in EXTRA and name not in configs:
            continue
        t0 = time.perf_counter()
        res = run_config(trace, name, base, profile, schedule=schedule)
        s = res.summary(ttft_s, tpot_s)
        row[name] = {
            "joint": round(s["joint_attainment"], 4),
            "rejected": s["rejected"],
            "expired": s["expired"],
            "failed": s["failed"],
            "switches": s["switches"],
            "tpot_missed_after_ttft": s["tpot_missed_after_ttft"],
            "wall_s": round(time.perf_counter() - t0, 2),
        }
        if name == ORACLE:  # the splits it chose
            schedule = oracle_schedule(res)
            row[name][SPLITS] = schedule_json(schedule)
        elif name == ORACLE_LIVE:  # those it followed (the oracle's, run again if not known)
            row[name][SPLITS] = res.notes[SCHEDULE_NOTE]
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    base = base_config(args)  # bad input: run_command's one line, exit 2
    if args.summarize:
        rows_in = load_rows(args.summarize)
        print(json.dumps({"bench": "sim-sweep", "cells": len(rows_in), **summarize(rows_in)}))
        return 0
    reused: dict[CellKey, dict[str, Any]] = {}
    if args.reuse:
        try:
            reused = {cell_key(r): r for r in load_rows(args.reuse)}
        except (OSError, ValueError, KeyError) as exc:
            print(f"fluidpd bench sim-sweep: --reuse {args.reuse}: {exc}", file=sys.stderr)
            return 2
    cells = cells_of(args)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("", encoding="utf-8")
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    def done(row: dict[str, Any]) -> None:
        rows.append(row)
        print(
            f"{row['workload']} seed={row['seed']} off={row['offset_s']:g} rps={row['rps']:g} "
            + " ".join(f"{c}={row[c]['joint']:.3f}" for c in (*CONFIGS, *EXTRA) if c in row)
            + f" sw={row[FULL]['switches']} rej={row[FULL]['rejected']}"
            + ("" if cell_goal_ok(row) else "  GOAL-MISS")
            + (" (tuned)" if row["tuned"] else ""),
            file=sys.stderr,
            flush=True,
        )
        if out is not None:
            with out.open("a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")

    if args.jobs == 1:
        for cell in cells:
            done(run_cell(cell, base, args.profile, args.configs, reused_for(cell, reused)))
    else:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            futures = [
                pool.submit(
                    run_cell, cell, base, args.profile, args.configs, reused_for(cell, reused)
                )
                for cell in cells
            ]
            for fut in futures:
                done(fut.result())
    summary = {
        "bench": "sim-sweep",
        "cells": len(rows),
        "policy": base.policy.rules,
        "policy_config": args.policy_config or None,
        "shedding": {
            "ttft_multiple": base.shedding.ttft_multiple,
            "expire_margin_s": base.shedding.expire_margin_s,
            "decode_backlog_batches": base.shedding.decode_backlog_batches,
        },
        "goal": f"full >= oracle - {SLACK_PP:g} pp in every cell; full >= oracle where "
        f"oracle < {HOPELESS}",
        "tune": {"seeds": args.tune_seeds, "offsets": args.tune_offsets},
        "ran": list(args.configs),
        "reused_from": args.reuse or None,
        "requests": {STAGED: args.requests_staged, MIXED: args.requests_mixed},
        **summarize(rows),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(run_command("fluidpd bench sim-sweep", main, sys.argv[1:]))
