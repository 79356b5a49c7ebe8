"""Defaults that the engine and the processes configuring it share; importable without torch
(a worker reads its flags and connects to the bus before it loads the engine)."""

import re

# The default KV arena. CPU arenas are zero-filled lazily by the OS (numpy calloc), so an
# unused part costs no memory.
DEFAULT_KV_CACHE_BYTES = 1024 * 1024 * 1024


def check_device_name(device: str) -> None:
    """Raises ValueError unless ``device`` is ``cpu``, ``cuda`` or ``cuda:N`` (torch
    would accept ``mps``, ``meta`` or ``cuda:x`` only to fail later, mid-startup)."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
