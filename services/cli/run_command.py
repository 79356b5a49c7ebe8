"""How every ``fluidpd`` subcommand runs: bad input ends in one line and exit code 2."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from shared.errors import InvalidRequestError, ModelLoadError

# What a command raises on input it cannot use: a config value its __post_init__ refuses
# (ValueError, which PolicyConfigError and the sim/cpu-set errors are), a request or
# workload it cannot build, a model or input file that is not there. Printed as one line;
# FLUIDPD_TRACEBACK=1 shows the traceback instead. Anything else is a bug: it keeps its
# traceback.
_INPUT_ERRORS = (
    ValueError,
    InvalidRequestError,
    ModelLoadError,
    FileNotFoundError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
)


def run_command(prog: str, command_main: Callable[[list[str]], int | None], argv: list[str]) -> int:
    """Run a subcommand's ``main``: its exit code, or 2 with a one-line ``PROG: error: ...``
    on stderr when it raises one of the input errors above (module comment)."""
    try:
        return int(command_main(argv) or 0)
    except _INPUT_ERRORS as exc:
        if os.environ.get("FLUIDPD_TRACEBACK") == "1":
            raise
        print(f"{prog}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
