"""Smoke test of ``fluidpd bench replay`` end to end: two fresh emulated 2P2D clusters
(static, full), 150 Azure-staged requests each, time-compressed; then the plots from its
output. Checks the pipeline (records, summary keys, counts, zero errors), not the numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.bench import crosscheck, plots, replay
from services.bench.config_list import config_names
from shared.engine.profiles import load_profile
from shared.policy.config import PolicyConfig

pytestmark = pytest.mark.timeout(240)

REQUESTS = 150
CONFIGS = ("static", "full")


def test_scaling_helpers_scale_every_time_coefficient_and_policy_time() -> None:
    base = load_profile("")
    scaled = replay.scaled_profile(base, 0.25)
    assert scaled.prefill_time_s(1000) == pytest.approx(0.25 * base.prefill_time_s(1000))
    assert scaled.decode_iter_time_s(8, 4000) == pytest.approx(
        0.25 * base.decode_iter_time_s(8, 4000)
    )
    assert scaled.suffix_time_s(300, 900) == pytest.approx(0.25 * base.suffix_time_s(300, 900))
    assert scaled.kv_capacity_tokens == base.kv_capacity_tokens
    pol = replay.scaled_policy(2000.0, 100.0, 0.25)
    assert (pol.ttft_ms, pol.tpot_ms) == (500.0, 25.0)
    assert pol.cooldown_s == pytest.approx(5.0) and pol.decision_interval_s == pytest.approx(0.25)
    assert pol.reverse_wait_s == pytest.approx(0.25 * PolicyConfig().reverse_wait_s)
    assert pol.reverse_wait_binds_s == pytest.approx(0.25 * PolicyConfig().reverse_wait_binds_s)
    assert pol.settle_s == pytest.approx(0.25 * PolicyConfig().settle_s)
    assert pol.decode_flow_window_s == pytest.approx(0.25 * PolicyConfig().decode_flow_window_s)


def test_static_paper_is_a_replay_and_crosscheck_configuration() -> None:
    assert "static-paper" in config_names("all", replay.CONFIGS)
    assert crosscheck.parse_points("static-paper:25,full:25") == [
        ("static-paper", 25.0),
        ("full", 25.0),
    ]
    with pytest.raises(ValueError, match="static-papr"):
        crosscheck.parse_points("static-papr:25")
    results = {
        "full": {"25": {"joint_attainment": 0.9}, "30": {"joint_attainment": 0.5}},
        "static-paper": {"25": {"joint_attainment": 0.55}},
        "static": {"30": {"joint_attainment": 0.45}},
    }
    assert replay.comparisons(results) == {
        "25": {"full_minus_static_paper_pp": 35.0},
        "30": {"full_minus_static_pp": 5.0},
    }
    assert replay.comparisons({"static": results["static"]}) == {}  # no full: nothing


def test_replay_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "replay"
    rc = replay.main(
        [
            "--workload", "azure-staged",
            "--config", ",".join(CONFIGS),
            "--rps", "12",
            "--requests", str(REQUESTS),
            "--time-scale", "0.5",
            "--workers", "4",
            "--out", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    assert summary["bench"] == "replay" and summary["time_scale"] == 0.5
    for cfg in CONFIGS:
        row = summary["results"][cfg]["12"]
        for key in ("ttft_attainment", "tpot_attainment", "joint_attainment"):
            assert 0.0 <= row[key] <= 1.0
        assert row["joint_attainment"] <= min(row["ttft_attainment"], row["tpot_attainment"])
        assert row["requests"] == REQUESTS
        assert row["completed"] + row["errors"] == REQUESTS
        # No accepted request fails; on a loaded machine the router may shed some (503
        # before any 200: counted apart, as not attained).
        assert row["failed_after_accept"] == 0, row
        assert row["errors"] == row["rejected"], row
        assert row["rejected_fraction"] == round(row["rejected"] / REQUESTS, 4)
        assert set(row["per_window"]) == {"0:conversation", "1:code", "2:conversation"}
        bn = row["loadgen_bottleneck"]
        assert bn["dispatch_lag_ms"]["p50"] is not None and "verdict" in bn
        assert bn["client_minus_server_first_token_ms"]["sampled"] > 0
        lines = Path(row["records"]).read_text().splitlines()
        assert len(lines) == REQUESTS
        recs = [json.loads(x) for x in lines]
        # A completed request carries every token it asked for; a shed one (503) none.
        assert all(r["num_tokens"] == r["output_tokens"] for r in recs if r["error"] is None)
        assert all(r["num_tokens"] == 0 for r in recs if r["error"] is not None)
        assert sum(r["error"] is None for r in recs) == row["completed"]
        run = json.loads((out / f"run-{cfg}-12.json").read_text())
        assert run["series"]["t_s"], "telemetry sampler recorded nothing"
        assert max(run["series"]["prefill_workers"]) >= 1
    # static never switches and never steals: its flags reached the workers and controller.
    static = summary["results"]["static"]["12"]
    assert static["switches"] == 0 and static["stolen_tokens"] == 0
    gap_pp = 100 * (
        summary["results"]["full"]["12"]["joint_attainment"] - static["joint_attainment"]
    )
    assert summary["comparisons"]["12"] == {"full_minus_static_pp": round(gap_pp, 1)}
    # The figures can be drawn from what the bench wrote.
    (tmp_path / "s.json").write_text(last)
    fig9, fig10 = tmp_path / "fig9.png", tmp_path / "fig10.png"
    assert plots.main(["attainment", "--input", str(tmp_path / "s.json"), "--out", str(fig9)]) == 0
    runs = [str(out / f"run-{c}-12.json") for c in CONFIGS]
    assert plots.main(["timeseries", "--input", *runs, "--out", str(fig10)]) == 0
    assert fig9.stat().st_size > 10_000 and fig10.stat().st_size > 10_000
