"""``fluidpd bench sim-sweep``: cells, tuned/held-out split, goal verdicts, JSON last line;
the rule-set flag of the controller and the simulator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.bench import sim_sweep
from services.bench.config_list import config_names
from services.bench.sim import base_config
from services.bench.sim import parse_args as sim_args
from services.controller.__main__ import config_from_args
from services.controller.__main__ import main as controller_main
from shared.policy.config import ADAPTIVE, PAPER, PolicyConfig


def row(full: float, oracle: float, tuned: bool = True, rps: float = 30.0) -> dict[str, object]:
    return {
        "workload": "azure-staged",
        "seed": 0,
        "offset_s": 0.0,
        "rps": rps,
        "tuned": tuned,
        "full": {"joint": full},
        "oracle": {"joint": oracle},
        "static": {"joint": 0.2},
        "static-pressure": {"joint": 0.4},
    }


def test_goal_per_cell() -> None:
    assert sim_sweep.cell_goal_ok(row(0.95, 0.97))  # within 3 pp
    assert not sim_sweep.cell_goal_ok(row(0.93, 0.97))  # 4 pp below
    assert not sim_sweep.cell_goal_ok(row(0.44, 0.45))  # oracle < 0.5: must not be below
    assert sim_sweep.cell_goal_ok(row(0.45, 0.45))


def test_summary_splits_tuned_and_held_out() -> None:
    rows = [row(0.99, 0.97), row(0.90, 0.97, tuned=False), row(0.98, 0.97, tuned=False)]
    s = sim_sweep.summarize(rows)
    assert s["goals"]["tuned"] == {"cells": 1, "cells_failed": 0, "holds": True, "failed_cells": []}
    assert s["goals"]["held_out"]["cells_failed"] == 1 and s["goals"]["held_out"]["holds"] is False
    cell = s["by_rps"]["azure-staged"]["30"]
    assert cell["all"]["full_minus_oracle_pp"] == {"min": -7.0, "median": 1.0}
    assert cell["held_out"]["cells"] == 2
    assert cell["all"]["full_minus_static_pp"]["median"] == pytest.approx(78.0)
    assert "full_minus_static_paper_pp" not in cell["all"]  # rows from before it existed


def test_summary_counts_the_cells_30pp_above_the_papers_baseline() -> None:
    rows = [dict(row(0.99, 0.97), **{"static-paper": {"joint": x}}) for x in (0.60, 0.70, 0.68)]
    cell = sim_sweep.summarize(rows)["by_rps"]["azure-staged"]["30"]["all"]
    assert cell["full_minus_static_paper_pp"] == {"min": 29.0, "median": 31.0}
    assert cell["cells_full_ge_static_paper_plus_30pp"] == 2
    # One cell without the baseline: the group reports nothing rather than a partial figure.
    cell = sim_sweep.summarize([*rows, row(0.99, 0.97)])["by_rps"]["azure-staged"]["30"]["all"]
    assert "full_minus_static_paper_pp" not in cell


def test_empty_goal_group_holds_none() -> None:
    """A sweep of only held-out cells has no tuned evidence: ``holds`` is None, not False."""
    s = sim_sweep.summarize([row(0.99, 0.97, tuned=False)])
    assert s["goals"]["tuned"] == {"cells": 0, "cells_failed": 0, "holds": None, "failed_cells": []}
    assert s["goals"]["held_out"]["holds"] is True
    s = sim_sweep.summarize([row(0.90, 0.97)])
    assert s["goals"]["tuned"]["holds"] is False
    assert s["goals"]["held_out"]["holds"] is None


def test_cells_mark_tuning_data() -> None:
    args = sim_sweep.parse_args(
        [
            "--seeds",
            "0,1,2",
            "--offsets",
            "0,600",
            "--rps-staged",
            "30",
            "--workloads",
            "azure-staged",
            "--tune-seeds",
            "0",
            "--tune-offsets",
            "0",
        ]
    )
    cells = sim_sweep.cells_of(args)
    assert len(cells) == 6
    assert [c.tuned for c in cells] == [True, False, False, False, False, False]
    assert [(c.seed, c.offset_s) for c in cells[:3]] == [(0, 0.0), (0, 600.0), (1, 0.0)]


def test_tiny_sweep_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    rc = sim_sweep.main(
        [
            "--workloads",
            "azure-mixed",
            "--seeds",
            "0,1",
            "--offsets",
            "0",
            "--rps-mixed",
            "20",
            "--requests-mixed",
            "200",
            "--tune-seeds",
            "0",
        ]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["bench"] == "sim-sweep" and summary["cells"] == 2
    assert summary["goals"]["tuned"]["cells"] == 1 and summary["goals"]["held_out"]["cells"] == 1
    assert set(summary["by_rps"]["azure-mixed"]["20"]["all"]) >= {
        "full_minus_oracle_pp",
        "full_minus_static_pp",
        "full_minus_static_pressure_pp",
        "full_minus_static_paper_pp",
    }


def test_rule_set_flags() -> None:
    assert config_from_args(["--policy", "paper"]).policy.rules == PAPER
    assert config_from_args([]).policy.rules == ADAPTIVE
    assert controller_main(["--policy", "bogus"]) == 2
    paper = base_config(sim_args(["--policy", "paper"]))
    assert paper.policy.rules == PAPER and not paper.migrate_on_drain  # drain by waiting
    off = base_config(sim_args(["--shed-ttft-multiple", "0", "--expire-margin-s", "-1"]))
    assert not off.shedding.sheds and off.shedding.expire_margin_s is None


def test_a_policy_config_file_is_a_variant_and_the_flags_given_override_it(
    tmp_path: Path,
) -> None:
    # What the controller's --policy-config takes, for bench sim / sim-sweep: a variant of
    # the policy is a file, not a script. --policy and the SLO flags apply on top only when
    # they are given.
    path = tmp_path / "variant.json"
    path.write_text(json.dumps({"n_persist_binds": 3, "rules": PAPER, "ttft_ms": 1500.0}))
    variant = base_config(sim_args(["--policy-config", str(path)])).policy
    assert (variant.n_persist_binds, variant.rules, variant.ttft_ms) == (3, PAPER, 1500.0)
    assert variant.tpot_ms == PolicyConfig().tpot_ms
    args = ["--policy-config", str(path), "--policy", "adaptive", "--slo-ttft-ms", "900"]
    over = base_config(sim_args(args))
    assert over.policy.rules == ADAPTIVE and over.policy.ttft_ms == 900.0
    assert over.policy.n_persist_binds == 3 and over.migrate_on_drain
    assert base_config(sim_args([])).policy == PolicyConfig()


def test_a_partial_rerun_takes_the_other_configurations_from_an_earlier_sweep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--workloads", "azure-mixed", "--seeds", "0", "--offsets", "0", "--rps-mixed"]
    common += ["20", "--requests-mixed", "150"]
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert sim_sweep.main([*common, "--out", str(first)]) == 0
    # Only `full` runs; the oracle and the static rows come from the first file. Its row
    # there is edited: a copied `full` would show -1, a re-run oracle its true value.
    (row_a,) = sim_sweep.load_rows(str(first))
    edited = dict(row_a, full={**row_a["full"], "joint": -1.0})
    edited["oracle"] = {**row_a["oracle"], "joint": 0.123}
    del edited["static-paper"]  # a row written before static-paper existed: it runs
    first.write_text(json.dumps(edited) + "\n", encoding="utf-8")
    args = [*common, "--configs", "full", "--reuse", str(first), "--out", str(second)]
    assert sim_sweep.main(args) == 0
    (row_b,) = sim_sweep.load_rows(str(second))
    assert row_b["full"]["joint"] == row_a["full"]["joint"]  # deterministic simulator
    assert row_b["oracle"]["joint"] == 0.123  # copied, not run
    for name in ("static", "static-pressure"):
        assert row_b[name] == row_a[name]
    assert row_b["static-paper"]["joint"] == row_a["static-paper"]["joint"]  # re-run
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["ran"] == ["full"] and summary["reused_from"] == str(first)
    # A subset of configurations without a file to take the rest from is a usage error.
    with pytest.raises(SystemExit) as exc:
        sim_sweep.main([*common, "--configs", "full"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        sim_sweep.main([*common, "--configs", "full,bogus", "--reuse", str(first)])


def test_a_cell_gets_only_the_reused_rows_of_its_own_trace() -> None:
    cell = sim_sweep.Cell("azure-mixed", seed=1, offset_s=600, rps=20, tuned=False)
    keys = [
        ("azure-mixed", 1, 600.0, 20.0, 150),  # this cell (a 150-request truncation)
        ("azure-mixed", 1, 600.0, 20.0, 9000),  # this cell, another truncation
        ("azure-mixed", 2, 600.0, 20.0, 150),  # another seed
        ("azure-mixed", 1, 0.0, 20.0, 150),  # another offset
        ("azure-mixed", 1, 600.0, 25.0, 150),  # another rate
        ("azure-staged", 1, 600.0, 20.0, 150),  # another workload
    ]
    reused = {k: {"n": i} for i, k in enumerate(keys)}
    assert sim_sweep.reused_for(cell, reused) == {keys[0]: {"n": 0}, keys[1]: {"n": 1}}


def test_config_lists_parse_the_same_way_in_every_benchmark() -> None:
    known = ("static", "full", "oracle")
    assert config_names("all", known) == ["static", "full", "oracle"]
    assert config_names(" full , static,", known) == ["full", "static"]  # order as given
    with pytest.raises(ValueError, match="unknown config 'bogus'; known: static, full, oracle"):
        config_names("full,bogus", known)
    with pytest.raises(ValueError, match="no config named"):
        config_names(" , ", known)
