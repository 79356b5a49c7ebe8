"""The command line of each child of a local cluster, built from its ``ClusterSpec``, and the
line each child logs once it is ready (the cluster waits for that marker).

Pure functions: nothing here starts a process or reads the environment.
"""

from __future__ import annotations

import re

from services.common.cluster_spec import ClusterSpec
from shared.policy.roles import Role

WORKER_READY = "worker_ready"
ROUTER_READY = "router_ready"
CONTROLLER_READY = "controller_ready"
# The router's ready line carries the URL it listens on (plain or JSON log format).
_URL_RE = re.compile(r"https?://[^\s\"',]+")


def router_url_of(ready_line: str) -> str | None:
    """The URL in the router's ready line (``router_ready url=http://HOST:PORT``, or the
    same in a JSON log line); None when there is none. Pure."""
    match = _URL_RE.search(ready_line)
    return match.group(0) if match else None


def _log_flags(spec: ClusterSpec) -> list[str]:
    return ["--log-json"] if spec.log_json else []


def controller_argv(spec: ClusterSpec, nats_url: str) -> list[str]:
    """The controller's command line (with ``spec.controller_args`` appended)."""
    argv = [
        spec.python,
        "-m",
        "services.controller",
        "--nats",
        nats_url,
        "--auto" if spec.auto_policy else "--no-auto",
        *_log_flags(spec),
    ]
    if spec.policy_config:
        argv += ["--policy-config", spec.policy_config]
    return argv + list(spec.controller_args)


def router_argv(spec: ClusterSpec, nats_url: str) -> list[str]:
    """The router's command line (with ``spec.router_args`` appended)."""
    return [
        spec.python,
        "-m",
        "services.router",
        "--nats",
        nats_url,
        "--model",
        spec.model,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        *_log_flags(spec),
        *spec.router_args,
    ]


def worker_argv(spec: ClusterSpec, worker_id: str, role: Role, nats_url: str) -> list[str]:
    """Worker ``worker_id``'s command line, first role ``role`` (with ``spec.worker_args``
    appended)."""
    argv = [spec.python, "-m", f"services.{role}_worker", "--id", worker_id]
    argv += ["--nats", nats_url, "--model", spec.model, "--engine", spec.engine]
    argv += _log_flags(spec)
    if spec.profile:
        argv += ["--profile", spec.profile]
    if spec.threads:
        argv += ["--threads", str(spec.threads)]
    if spec.time_scale is not None:
        argv += ["--time-scale", str(spec.time_scale)]
    if spec.policy_config:
        argv += ["--policy-config", spec.policy_config]
    return argv + list(spec.worker_args)
