"""``fluidpd bench NAME``: each benchmark prints a JSON summary as its last line."""

from __future__ import annotations

import importlib
import sys

from services.cli.run_command import run_command

_BENCHES = {
    "engine": "services.bench.engine",
    "kv": "services.bench.kv",
    "control": "services.bench.control",
    "serve": "services.bench.serve",
    "switch": "services.bench.switch",
    "replay": "services.bench.replay",
    "soak": "services.bench.soak",
    "fluidtoken": "services.bench.fluidtoken",
    "shift": "services.bench.shift",
    "sim": "services.bench.sim",
    "sim-sweep": "services.bench.sim_sweep",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in _BENCHES:
        print(f"usage: fluidpd bench {{{','.join(_BENCHES)}}} [options]", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(_BENCHES[argv[0]])
    except ModuleNotFoundError as exc:
        print(f"fluidpd bench {argv[0]}: not available in this build ({exc})", file=sys.stderr)
        return 2
    return run_command(f"fluidpd bench {argv[0]}", module.main, argv[1:])
