"""CPU sets for a local cluster (services/common/cpus.py): parsing, validation, and that a
child process really runs pinned."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.cluster_spec import ClusterSpec
from services.common.cpus import (
    CpuSetError,
    available_cpus,
    check_cpus,
    parse_cpus,
    split_control_workers,
)
from services.common.procs import ChildProcess

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("", ()), ("0", (0,)), ("3,1", (1, 3)), ("0,2-4", (0, 2, 3, 4)), (" 1 , 1-2 ", (1, 2))],
)
def test_parse_cpus(text: str, expected: tuple[int, ...]) -> None:
    assert parse_cpus(text) == expected


@pytest.mark.parametrize("text", ["a", "1-", "-1", "3-1", "0,x-2", "1.5"])
def test_parse_cpus_rejects(text: str) -> None:
    with pytest.raises(CpuSetError):
        parse_cpus(text)


def test_check_cpus_names_the_missing_cpu() -> None:
    here = available_cpus()
    assert check_cpus(reversed(here), "x") == here
    with pytest.raises(CpuSetError, match="4096"):
        check_cpus((4096,), "worker CPUs")
    with pytest.raises(ValueError, match="control plane CPUs"):
        ClusterSpec(control_cpus=(4096,))


def test_split_control_workers() -> None:
    control, workers = split_control_workers()
    here = available_cpus()
    if len(here) < 2:
        assert (control, workers) == ((), ())
    else:
        assert control == here[:1] and workers == here[1:]


def test_child_process_runs_pinned_with_its_threads() -> None:
    cpu = available_cpus()[-1]
    script = (
        "import os, threading\n"
        "out = []\n"
        "t = threading.Thread(target=lambda: out.append(sorted(os.sched_getaffinity(0))))\n"
        "t.start(); t.join()\n"
        "print('pinned', sorted(os.sched_getaffinity(0)), out[0], flush=True)\n"
    )
    child = ChildProcess("pin", [sys.executable, "-c", script], cpus=(cpu,), die_with_parent=True)
    child.start()
    assert child.exited.wait(30) and child.wait(5) == 0  # output fully pumped
    assert f"pinned [{cpu}] [{cpu}]" in child.tail()


def test_up_rejects_a_bad_cpu_list_in_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "up", "--control-cpus", "0-x"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "FLUIDPD_NATS_URL": ""},
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "bad CPU list" in proc.stderr
