"""Per-block KV checksums (shared/transfer/checksum.py), device-agnostic code on CPU tensors.

fold64 is what a CUDA arena is hashed with; the same torch function runs here on CPU
tensors and is checked against an independent numpy (uint64, natively wrapping) reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.transfer import checksum
from shared.transfer.checksum import (
    FOLD64,
    XXH3,
    BlockHasher,
    algorithm_for,
    block_checksums,
)


def fold64_reference(run: np.ndarray, block_nbytes: int) -> list[int]:
    """The module docstring's formula, written out with numpy uint64 arithmetic."""
    words = run.view("<u8").reshape(-1, block_nbytes // 8)
    with np.errstate(over="ignore"):
        keys = np.arange(1, words.shape[1] + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        x = words ^ keys
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
        return [int(v) for v in x.sum(axis=1, dtype=np.uint64)]


def random_run(seed: int, blocks: int, block_nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, blocks * block_nbytes, dtype=np.uint8)


@settings(max_examples=25, deadline=None)
@given(
    blocks=st.integers(1, 9),
    block_nbytes=st.sampled_from([8, 64, 4096, 16384]),
    seed=st.integers(0, 2**32 - 1),
)
def test_fold64_matches_the_reference_on_cpu_tensors(
    blocks: int, block_nbytes: int, seed: int
) -> None:
    run = random_run(seed, blocks, block_nbytes)
    expected = fold64_reference(run, block_nbytes)
    assert block_checksums(torch.from_numpy(run), block_nbytes, FOLD64) == expected
    assert block_checksums(run, block_nbytes, FOLD64) == expected  # host arrays too
    assert all(0 <= v < 2**64 for v in expected)


def test_fold64_in_chunks_equals_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    run = random_run(7, 37, 512)
    whole = block_checksums(run, 512, FOLD64)
    monkeypatch.setattr(checksum, "_CHUNK_WORDS", 3 * 64)  # 3 blocks per step, a ragged end
    assert block_checksums(run, 512, FOLD64) == whole == fold64_reference(run, 512)


@pytest.mark.parametrize("algorithm", [XXH3, FOLD64])
def test_any_change_shows_in_its_own_block_only(algorithm: str) -> None:
    block = 4096
    run = random_run(3, 6, block)
    base = block_checksums(run, block, algorithm)
    assert len(set(base)) == 6
    flipped = run.copy()
    flipped[4 * block + 1234] ^= 0x01
    got = block_checksums(flipped, block, algorithm)
    assert got[4] != base[4] and got[:4] == base[:4] and got[5:] == base[5:]
    swapped = run.copy().view("<u8")  # two different words of block 2 change places
    w = 2 * block // 8
    swapped[[w + 3, w + 100]] = swapped[[w + 100, w + 3]]
    got = block_checksums(swapped.view(np.uint8), block, algorithm)
    assert got[2] != base[2] and got[:2] == base[:2] and got[3:] == base[3:]


def test_xxh3_of_a_tensor_is_xxh3_of_its_bytes() -> None:
    run = random_run(11, 3, 1024)
    expected = [
        xxhash.xxh3_64_intdigest(run[i * 1024 : (i + 1) * 1024].tobytes()) for i in range(3)
    ]
    assert block_checksums(torch.from_numpy(run), 1024, XXH3) == expected
    assert block_checksums(run, 1024) == expected  # xxh3 stays the default name


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown checksum algorithm"):
        block_checksums(np.zeros(64, dtype=np.uint8), 64, "crc32")
    with pytest.raises(ValueError, match="whole"):
        block_checksums(np.zeros(100, dtype=np.uint8), 64, FOLD64)
    with pytest.raises(ValueError, match="64-bit words"):
        block_checksums(np.zeros(24, dtype=np.uint8), 12, FOLD64)
    with pytest.raises(ValueError):
        BlockHasher("md5", 64)


def test_each_device_has_its_algorithm_and_the_hasher_runs_it() -> None:
    assert algorithm_for("cpu") == XXH3
    assert algorithm_for(torch.device("cuda", 0)) == FOLD64  # no CUDA needed to name it
    run = torch.from_numpy(random_run(5, 4, 256))
    for algorithm in (XXH3, FOLD64):
        hasher = BlockHasher(algorithm, 256, run.device)
        assert hasher.algorithm == algorithm
        assert hasher(run) == block_checksums(run.numpy(), 256, algorithm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fold64_on_cuda_equals_cpu() -> None:
    run = torch.from_numpy(random_run(9, 64, 16384))
    hasher = BlockHasher(FOLD64, 16384, "cuda")
    assert hasher(run.cuda()) == block_checksums(run, 16384, FOLD64)
