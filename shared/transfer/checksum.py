"""Per-block KV checksums, computed on the device where the KV lives.

Two algorithms, named in the envelope (``Envelope.checksum_algorithm``) so both sides
agree whatever device each one's arena is on:

- ``xxh3_64``: xxhash over host bytes. The CPU default: one pass at memory speed that
  releases the GIL (``fold64`` in torch on CPU is several times slower: many passes).
- ``fold64``: a vectorised hash in torch ops, for arenas in CUDA memory, where copying
  every block to the host just to hash it would cost a PCIe round trip per transfer.
  Each block is read as little-endian 64-bit words ``w_i`` (i = word index in the block);
  each word is keyed by its position and mixed (splitmix64's finaliser), and the block's
  checksum is the wrapping sum of the mixed words:

      x_i = mix(w_i XOR key_i),  key_i = (i + 1) * 0x9E3779B97F4A7C15  (mod 2**64)
      mix(x) = m2(m1(x)),  m1(x) = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9,
                            m2(x) = (x ^ (x >> 27)) * 0x94D049BB133111EB,  then x ^ (x >> 31)
      checksum = sum_i x_i  (mod 2**64)

  ``mix`` is a bijection, so a single changed word always changes its term; the position
  key makes moved or swapped words count. The sum is order-free modulo 2**64, so a GPU's
  reduction order gives the same value as the CPU's: the same function runs on either
  device (the tests run it on CPU tensors against a numpy reference). It is an integrity
  check against misplaced or torn copies, not a MAC: authenticity comes from the sealed
  envelope and trailer.

A receiver computes whichever algorithm the envelope names (a CUDA sender may feed a CPU
receiver); a name it does not know is a rejection.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import xxhash

XXH3 = "xxh3_64"
FOLD64 = "fold64"
ALGORITHMS = (XXH3, FOLD64)

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
# One fold64 step touches at most this many words (int64 temporaries stay ~2x this).
_CHUNK_WORDS = 1 << 24


def algorithm_for(device: torch.device | str) -> str:
    """The checksum a sender on ``device`` computes: fold64 on CUDA, xxh3_64 elsewhere."""
    return FOLD64 if torch.device(device).type == "cuda" else XXH3


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch arithmetic takes."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _lsr(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def _as_tensor(run: Any) -> torch.Tensor:
    if isinstance(run, torch.Tensor):
        return run
    if isinstance(run, np.ndarray):
        return torch.from_numpy(run.reshape(-1).view(np.uint8))
    return torch.from_numpy(np.frombuffer(run, dtype=np.uint8).copy())  # bytes: tests only


def _as_host_bytes(run: Any) -> memoryview:
    if isinstance(run, np.ndarray):
        return run.data.cast("B")
    if isinstance(run, torch.Tensor):
        # A CUDA run under xxh3 (a CPU peer asked for it) is the one staging copy left.
        return (run.numpy() if run.device.type == "cpu" else run.cpu().numpy()).data.cast("B")
    return memoryview(run).cast("B")


def xxh3_block_checksums(run: Any, block_nbytes: int) -> list[int]:
    """xxh3_64 of each ``block_nbytes`` block of ``run`` (host bytes, or a tensor).

    Pure; releases the GIL inside xxhash, so it may run in a worker thread.
    """
    data = _as_host_bytes(run)
    if data.nbytes % block_nbytes:
        raise ValueError(f"run of {data.nbytes} bytes is not whole {block_nbytes}-byte blocks")
    # Slicing a memoryview costs a third of slicing the ndarray (per block, at 16 KiB
    # blocks that is most of the non-hashing time).
    digest = xxhash.xxh3_64_intdigest
    return [digest(data[i : i + block_nbytes]) for i in range(0, data.nbytes, block_nbytes)]


def fold64_block_checksums(run: Any, block_nbytes: int) -> list[int]:
    """fold64 (module docstring) of each block of ``run``, on the device ``run`` is on.

    ``run``: a contiguous uint8 tensor (or host array) of whole blocks; ``block_nbytes``
    must be a multiple of 8. Pure (reads ``run`` only); on CUDA the ops are queued on the
    caller's current stream and the call returns after they finish.
    Raises ValueError on partial blocks or a block size not a multiple of 8.
    """
    data = _as_tensor(run)
    if data.numel() % block_nbytes:
        raise ValueError(f"run of {data.numel()} bytes is not whole {block_nbytes}-byte blocks")
    if block_nbytes % 8:
        raise ValueError(f"fold64 needs blocks of whole 64-bit words, got {block_nbytes} bytes")
    words_per_block = block_nbytes // 8
    words = data.reshape(-1).view(torch.int64).view(-1, words_per_block)
    keys = _position_keys(words_per_block, data.device)
    step = max(1, _CHUNK_WORDS // words_per_block)
    sums = []
    for first in range(0, words.shape[0], step):
        x = words[first : first + step] ^ keys
        x ^= _lsr(x, 30)
        x *= _signed(_M1)
        x ^= _lsr(x, 27)
        x *= _signed(_M2)
        x ^= _lsr(x, 31)
        sums.append(x.sum(dim=1))  # int64 sums wrap: the value mod 2**64 on any device
    flat = torch.cat(sums).tolist() if sums else []
    return [v & _MASK64 for v in flat]


def _position_keys(words_per_block: int, device: torch.device) -> torch.Tensor:
    idx = np.arange(1, words_per_block + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        keys = idx * np.uint64(_GOLDEN)
    return torch.from_numpy(keys.view(np.int64)).to(device)


def block_checksums(run: Any, block_nbytes: int, algorithm: str = XXH3) -> list[int]:
    """Each block's checksum under ``algorithm`` (one of ALGORITHMS), in order.

    Raises ValueError on an unknown algorithm or partial blocks.
    """
    if algorithm == XXH3:
        return xxh3_block_checksums(run, block_nbytes)
    if algorithm == FOLD64:
        return fold64_block_checksums(run, block_nbytes)
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


class BlockHasher:
    """Checksums of one algorithm and block size, on the device the KV lives on.

    On CUDA it hashes on a stream of its own (made at construction), after the work
    already queued on the caller's stream, so a receive's hash does not wait behind the
    engine's forward passes on the default stream. Safe to call from one thread at a time
    per instance (the sender's and the receiver's hash threads each own one).
    """

    def __init__(self, algorithm: str, block_nbytes: int, device: torch.device | str = "cpu"):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown checksum algorithm {algorithm!r}")
        if block_nbytes <= 0:
            raise ValueError("block_nbytes must be > 0")
        self.algorithm = algorithm
        self.block_nbytes = block_nbytes
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._fn = xxh3_block_checksums if algorithm == XXH3 else fold64_block_checksums

    def __call__(self, run: Any) -> list[int]:
        """Checksums of every block of ``run`` (logical order). Raises ValueError."""
        if self._stream is None or not isinstance(run, torch.Tensor) or not run.is_cuda:
            return self._fn(run, self.block_nbytes)
        self._stream.wait_stream(torch.cuda.current_stream(run.device))
        with torch.cuda.stream(self._stream):
            return self._fn(run, self.block_nbytes)
