"""``fluidpd`` console script: one entry point, one module per subcommand."""

from __future__ import annotations

import argparse
import importlib
import sys

from services.cli.run_command import run_command

# subcommand -> (module, help). Modules are imported lazily so that `fluidpd ctl` and the
# router never pay for importing torch.
_COMMANDS = {
    "up": ("services.cli.up", "start a whole local cluster (nats, controller, router, workers)"),
    "generate": ("services.cli.generate", "run the engine on a prompt in this process (no bus)"),
    "ctl": ("services.cli.ctl", "operator commands over NATS: status, switch, policy"),
    "calibrate": ("services.cli.calibrate", "profile the engine and write a latency profile"),
    "bench": ("services.cli.bench", "benchmarks; each prints a JSON summary as its last line"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="fluidpd", description=__doc__)
    parser.add_argument("command", choices=sorted(_COMMANDS), help="subcommand")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        print("\nsubcommands:")
        for name, (_, text) in _COMMANDS.items():
            print(f"  {name:10s} {text}")
        return 0 if argv else 2
    args = parser.parse_args(argv[:1])
    module = importlib.import_module(_COMMANDS[args.command][0])
    return run_command(f"fluidpd {args.command}", module.main, argv[1:])


if __name__ == "__main__":
    sys.exit(main())
