"""FluidRole on the worker: the in-place role switch, its lease, and request migration."""
