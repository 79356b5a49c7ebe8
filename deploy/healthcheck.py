"""Container health check of FluidPD processes (stdlib only; the images copy it).

    python healthcheck.py [worker|router|controller|URL]

Without an argument the kind comes from ``$FLUIDPD_HEALTHCHECK`` (the images set it). The
port comes from the same variables the process reads, so the check follows the compose file:

- ``worker``: ``GET /metrics`` on ``$FLUIDPD_METRICS_PORT`` (the worker serves it once its
  engine is loaded and it is registered; a worker without a metrics port cannot be checked).
- ``router``: ``GET /health`` on ``$FLUIDPD_ROUTER_PORT`` (default 8000): 200 only while NATS
  is connected and at least one active prefill and one active decode worker are registered.
- ``controller``: ``GET /metrics`` on ``$FLUIDPD_CONTROLLER_METRICS_PORT``.

Exit status 0 when the endpoint answers 200 within ``$FLUIDPD_HEALTHCHECK_TIMEOUT_S`` (3 s),
else 1 with one line on stderr saying why.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

_KINDS = {
    "worker": ("FLUIDPD_METRICS_PORT", "", "/metrics"),
    "router": ("FLUIDPD_ROUTER_PORT", "8000", "/health"),
    "controller": ("FLUIDPD_CONTROLLER_METRICS_PORT", "", "/metrics"),
}


def url_for(kind: str, env: dict[str, str]) -> str:
    """The URL to probe for ``kind`` (or ``kind`` itself when it is a URL). Raises ValueError."""
    if kind.startswith(("http://", "https://")):
        return kind
    if kind not in _KINDS:
        raise ValueError(f"unknown kind {kind!r} (worker, router, controller or a URL)")
    var, default, path = _KINDS[kind]
    port = env.get(var, default) or default
    if not port or port == "0":
        raise ValueError(f"{var} is not set: {kind} serves no HTTP endpoint to check")
    return f"http://127.0.0.1:{int(port)}{path}"


def main(argv: list[str]) -> int:
    env = dict(os.environ)
    kind = argv[0] if argv else env.get("FLUIDPD_HEALTHCHECK", "")
    try:
        url = url_for(kind, env)
        timeout_s = float(env.get("FLUIDPD_HEALTHCHECK_TIMEOUT_S", "3"))
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            if resp.status == 200:
                return 0
            print(f"unhealthy: {url} answered {resp.status}", file=sys.stderr)
    except urllib.error.HTTPError as exc:
        print(f"unhealthy: {url} answered {exc.code}", file=sys.stderr)
    except (OSError, ValueError) as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
