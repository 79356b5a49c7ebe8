"""Defaults that the engine and the processes configuring it share; importable without torch
(a worker reads its flags and connects to the bus before it loads the engine)."""

# The default KV arena. CPU arenas are zero-filled lazily by the OS (numpy calloc), so an
# unused part costs no memory.
DEFAULT_KV_CACHE_BYTES = 1024 * 1024 * 1024
