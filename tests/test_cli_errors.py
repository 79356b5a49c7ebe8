"""The ``fluidpd`` console script on input it cannot use: one line, exit code 2, no traceback
(services/cli/run_command.py). Real subprocesses of the installed entry point."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.cli.run_command import run_command


def _run_module(
    module: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def _fluidpd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return _run_module("services.cli.main", *args, env=env)


@pytest.mark.parametrize(
    ("args", "prog", "says"),
    [
        (
            ("bench", "sim", "--rps", "-3", "--requests", "5"),
            "fluidpd bench sim",
            "rps must be > 0",
        ),
        (
            ("bench", "sim", "--config", "static-paper", "--slo-ttft-ms", "70000"),
            "fluidpd bench sim",
            "TTFT SLO must be in (0, 60] s",
        ),
        (("bench", "sim-sweep", "--seeds", "x"), "fluidpd bench sim-sweep", "'x'"),
        (
            ("bench", "sim-sweep", "--summarize", "/nonexistent/cells.jsonl"),
            "fluidpd bench sim-sweep",
            "/nonexistent/cells.jsonl",
        ),
        (("calibrate", "--model", "/nonexistent/model"), "fluidpd calibrate", "no such file"),
        (("bench", "replay", "--config", "bogus"), "fluidpd bench replay", "'bogus'"),
        (("bench", "sim", "--config", "bogus"), "fluidpd bench sim", "'bogus'"),
        (
            ("bench", "sim", "--policy-config", "/nonexistent/policy.json"),
            "fluidpd bench sim",
            "/nonexistent/policy.json",
        ),
        (
            ("bench", "sim-sweep", "--policy-config", "/dev/null"),
            "fluidpd bench sim-sweep",
            "policy config is not JSON",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: tuple[str, ...], prog: str, says: str) -> None:
    proc = _fluidpd(*args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), proc.stderr
    assert says in lines[0]


def test_traceback_on_request() -> None:
    proc = _fluidpd(
        "bench", "sim", "--rps", "-3", "--requests", "5", env={"FLUIDPD_TRACEBACK": "1"}
    )
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "WorkloadError: rps must be > 0" in proc.stderr


def test_a_bug_keeps_its_traceback() -> None:
    def buggy(argv: list[str]) -> int:
        raise RuntimeError("not an input error")

    with pytest.raises(RuntimeError, match="not an input error"):
        run_command("fluidpd x", buggy, [])
    assert run_command("fluidpd x", lambda argv: 3, []) == 3
    assert run_command("fluidpd x", lambda argv: None, []) == 0


@pytest.mark.parametrize("points", ["full:x", "nope:3", "full:0", "full:10,static"])
def test_crosscheck_refuses_a_bad_point_before_running_any(points: str, tmp_path) -> None:
    out = tmp_path / "xcheck"
    proc = _run_module("services.bench.crosscheck", "--points", points, "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("python -m services.bench.crosscheck: error: ValueError: bad point")
    assert not out.exists()  # refused before the profile or any run was written
