"""KV arena sizing from a device-memory fraction (vLLM's ``--gpu-memory-utilization``)."""

from __future__ import annotations

import torch

from shared.errors import FluidPDError


class MemoryBudgetError(FluidPDError):
    """The memory fraction leaves no room for the KV cache on this device."""

    code = "memory_budget"


def kv_budget_bytes(device: torch.device, utilization: float) -> int:
    """Bytes the KV arena may take so that this process uses at most ``utilization`` of
    the device's memory: the fraction of its total minus what is in use now (call after
    the weights are on the device; as in vLLM, other processes' memory counts as used).
    Activations are not reserved separately: a fraction below 1 leaves their room.

    Raises MemoryBudgetError when that is not positive, ValueError off CUDA.
    """
    if device.type != "cuda":
        raise ValueError("gpu_memory_utilization needs a CUDA device; size the KV cache in MiB")
    free, total = torch.cuda.mem_get_info(device)
    budget = int(utilization * total) - (total - free)
    if budget <= 0:
        raise MemoryBudgetError(
            f"gpu_memory_utilization {utilization:g} of {total >> 20} MiB leaves no room for "
            f"the KV cache ({(total - free) >> 20} MiB already in use)"
        )
    return budget
