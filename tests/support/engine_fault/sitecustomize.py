"""Engine-step fault injection for real worker processes (tests only; the emulated engine
is the GPU stand-in, and this is how a CUDA OOM reaches the worker).

Put this folder first on PYTHONPATH and set ``FLUIDPD_TEST_ENGINE_FAULT_DIR``: from then
on, a worker process whose ``--id`` names a file in that folder raises from every
``EmulatedEngine.step`` it runs (the test creates the file when it wants the fault). Any
other process (router, controller, CLI) is left alone and does not import the engine.
"""

from __future__ import annotations

import os
from typing import Any


def _install() -> None:
    fault_dir = os.environ.get("FLUIDPD_TEST_ENGINE_FAULT_DIR")
    if not fault_dir:
        return
    try:
        with open("/proc/self/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return
    if not any(a.startswith(b"services.") and a.endswith(b"_worker") for a in argv):
        return
    if b"--id" not in argv:
        return
    worker_id = argv[argv.index(b"--id") + 1].decode()
    from shared.engine import emulated

    original = emulated.EmulatedEngine.step

    def step(self: Any, steps: Any, specs: Any) -> Any:
        if os.path.exists(os.path.join(fault_dir, worker_id)):
            raise RuntimeError("CUDA out of memory (fault injected by the test)")
        return original(self, steps, specs)

    emulated.EmulatedEngine.step = step  # type: ignore[method-assign]


_install()
