"""The robustness sweep's verdict (``fluidpd bench sim-sweep``): whether one cell meets the
goals, and the per-RPS distributions and goal verdicts over many cells, tuned and held-out
cells apart. Pure: rows in (sim_sweep.py's one JSON object per cell), a dict out.

The goals (issue 16): full >= oracle − ``SLACK_PP`` in every cell, and full >= oracle in
every cell where the oracle is below ``HOPELESS``.
"""

from __future__ import annotations

import statistics
from typing import Any

from services.sim.config import FULL, ORACLE, ORACLE_LIVE, STATIC, STATIC_PAPER, STATIC_PRESSURE

SLACK_PP = 3.0  # full >= oracle − 3 pp in every cell
HOPELESS = 0.5  # where the oracle is below this, full >= oracle
# Issue 16's cross-check goal, full >= static + 30 pp, counted against the paper's baseline.
PAPER_MARGIN_PP = 30.0


def cell_goal_ok(row: dict[str, Any], config: str = FULL) -> bool:
    """Whether ``config`` (default full) meets the goals against the oracle in this row."""
    full, oracle = row[config]["joint"], row[ORACLE]["joint"]
    if full < oracle - SLACK_PP / 100:
        return False
    return not (oracle < HOPELESS and full < oracle)


def _dist(values: list[float]) -> dict[str, float]:
    return {"min": round(min(values), 1), "median": round(statistics.median(values), 1)}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-RPS distributions and the goal verdicts, tuned and held-out apart. A goal group
    with no cells reports ``"holds": None`` (no evidence), never ``False``."""
    by_rps: dict[str, dict[str, Any]] = {}
    goals: dict[str, dict[str, Any]] = {}
    for part, keep in (("tuned", True), ("held_out", False)):
        sel = [r for r in rows if r["tuned"] is keep]
        failed = [r for r in sel if not cell_goal_ok(r)]
        goals[part] = {
            "cells": len(sel),
            "cells_failed": len(failed),
            # An empty group (e.g. a sweep of only held-out cells) is no evidence either way.
            "holds": (not failed) if sel else None,
            "failed_cells": [
                {k: r[k] for k in ("workload", "seed", "offset_s", "rps")}
                | {"full": r[FULL]["joint"], "oracle": r[ORACLE]["joint"]}
                | ({"oracle_live": r[ORACLE_LIVE]["joint"]} if ORACLE_LIVE in r else {})
                for r in failed
            ],
        }
    keys = sorted({(r["workload"], r["rps"]) for r in rows})
    for workload, rps in keys:
        for part, sel_fn in (
            ("all", lambda r: True),
            ("held_out", lambda r: not r["tuned"]),
        ):
            sel = [r for r in rows if r["workload"] == workload and r["rps"] == rps and sel_fn(r)]
            if not sel:
                continue

            def pp(a: str, b: str, rs: list[dict[str, Any]] = sel) -> list[float]:
                return [100.0 * (r[a]["joint"] - r[b]["joint"]) for r in rs]

            stats: dict[str, Any] = {
                "cells": len(sel),
                "full_minus_oracle_pp": _dist(pp(FULL, ORACLE)),
                "full_minus_static_pp": _dist(pp(FULL, STATIC)),
                "full_minus_static_pressure_pp": _dist(pp(FULL, STATIC_PRESSURE)),
                "full_median": round(statistics.median(r[FULL]["joint"] for r in sel), 3),
                "oracle_median": round(statistics.median(r[ORACLE]["joint"] for r in sel), 3),
                "oracle_min": round(min(r[ORACLE]["joint"] for r in sel), 3),
                "goal_cells_failed": sum(1 for r in sel if not cell_goal_ok(r)),
            }
            # Rows of sweeps before static-paper existed lack it: reported only when all
            # of the group's cells have it.
            if all(STATIC_PAPER in r for r in sel):
                stats["full_minus_static_paper_pp"] = _dist(pp(FULL, STATIC_PAPER))
                stats["cells_full_ge_static_paper_plus_30pp"] = sum(
                    1 for x in pp(FULL, STATIC_PAPER) if x >= PAPER_MARGIN_PP
                )
            # The oracle-live yardstick (services/sim/oracle_live.py), when every cell has it:
            # the oracle's clean-start premium, FluidRole against the clairvoyant schedule,
            # and the cells where even that schedule misses the goals.
            if all(ORACLE_LIVE in r for r in sel):
                stats["oracle_live_minus_oracle_pp"] = _dist(pp(ORACLE_LIVE, ORACLE))
                stats["full_minus_oracle_live_pp"] = _dist(pp(FULL, ORACLE_LIVE))
                stats["oracle_live_goal_cells_failed"] = sum(
                    1 for r in sel if not cell_goal_ok(r, ORACLE_LIVE)
                )
            by_rps.setdefault(workload, {}).setdefault(f"{rps:g}", {})[part] = stats
    return {"goals": goals, "by_rps": by_rps}
