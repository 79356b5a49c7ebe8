"""What both ends of ``fluidpd bench kv`` (services/bench/kv.py) agree on: the arena shape,
how an arena is made and filled, its fingerprint and the cluster secret."""

from __future__ import annotations

from typing import Any

import numpy as np

MIB = 1 << 20
# Arena shape: 8 layers x (k, v) x 16 tokens x 2 heads x head_dim float32 = 2 KiB x head_dim.
LAYERS, HEADS, BLOCK_TOKENS = 8, 2, 16
MAX_BLOCKS_PER_TRANSFER = 16384


def make_arena(num_blocks: int, block_kib: int, device: str = "cpu") -> Any:
    """A KVArena of ``num_blocks`` blocks of ``block_kib`` KiB, filled with a byte pattern
    (on ``device``: cpu, or cuda[:N])."""
    import torch

    from shared.engine.kv_arena import KVArena

    if device != "cpu":  # device memory, as a GPU worker's arena: UCX reads/writes it
        arena = KVArena(
            num_blocks, LAYERS, HEADS, block_kib // 2, BLOCK_TOKENS, torch.float32, device
        )
        flat = arena.tensor.view(-1).view(torch.uint8)
        flat.copy_(
            torch.arange(flat.numel(), dtype=torch.int64, device=device).remainder_(251).byte()
        )
        torch.cuda.synchronize(device)
        return arena
    arena = KVArena(1, LAYERS, HEADS, block_kib // 2, BLOCK_TOKENS, torch.float32)
    # Back the arena with transparent huge pages (numpy madvises large allocations; torch's
    # CPU allocator does not): UCX's shared-memory copy (CMA) pins pages one by one and
    # runs at ~9 GB/s on 4 KiB pages vs ~17 GB/s on 2 MiB pages on this host.
    shape = (num_blocks, *arena.tensor.shape[1:])
    backing = np.zeros(num_blocks * arena.block_nbytes, dtype=np.uint8)
    arena.tensor = torch.from_numpy(backing).view(torch.float32).view(shape)
    arena.num_blocks = num_blocks
    flat = arena.tensor.view(-1).view(torch.uint8)
    flat.copy_(torch.arange(flat.numel(), dtype=torch.int64).remainder_(251).to(torch.uint8))
    return arena


def bench_fingerprint(arena: Any) -> Any:
    from shared.transfer import KVFingerprint

    return KVFingerprint("bench", "w", "float32", BLOCK_TOKENS, arena.layout)


SECRET = b"bench-secret-not-for-production"
