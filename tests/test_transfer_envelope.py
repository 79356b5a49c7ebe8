"""Envelope helpers on the transfer's hot path (pure: no UCX, no processes).

The bandwidth work replaced ``asdict`` encoding and ndarray slicing with cheaper
equivalents; these tests pin that the bytes checked on both sides did not change meaning.
"""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.transfer import TransferRejected
from shared.transfer.envelope import (
    Envelope,
    block_checksums,
    decode_trailer,
    encode_trailer,
)

SECRET = b"k" * 32


@settings(max_examples=30, deadline=None)
@given(
    blocks=st.integers(1, 9),
    block_nbytes=st.sampled_from([64, 4096, 16384]),
    seed=st.integers(0, 2**32 - 1),
)
def test_block_checksums_are_xxh3_of_each_block(blocks: int, block_nbytes: int, seed: int) -> None:
    run = np.random.default_rng(seed).integers(0, 256, blocks * block_nbytes, dtype=np.uint8)
    expected = [
        xxhash.xxh3_64_intdigest(run[i * block_nbytes : (i + 1) * block_nbytes].tobytes())
        for i in range(blocks)
    ]
    assert block_checksums(run, block_nbytes) == expected
    flipped = run.copy()
    flipped[(blocks - 1) * block_nbytes + seed % block_nbytes] ^= 1
    got = block_checksums(flipped, block_nbytes)
    assert got[:-1] == expected[:-1] and got[-1] != expected[-1]


def test_block_checksums_refuse_partial_blocks() -> None:
    with pytest.raises(ValueError):
        block_checksums(np.zeros(100, dtype=np.uint8), 64)


def _envelope(n: int) -> Envelope:
    return Envelope(
        transfer_id=1 << 20,
        request_id="r",
        fingerprint_digest="f" * 64,
        token_start=0,
        token_end=16 * n,
        num_blocks=n,
        block_nbytes=4096,
        generations=tuple(range(n)),
        segments=((0, n),),
        src_worker_id="p0",
        dst_worker_id="d0",
        src_address=b"addr",
        src_host_id="h",
        has_checksums=True,
        meta={"first_token": 7},
    )


def test_envelope_and_trailer_round_trip_and_bind() -> None:
    env = _envelope(1000)
    frame, mac = env.encode(SECRET)
    decoded, mac2 = Envelope.decode(frame, SECRET)
    assert decoded == env and mac2 == mac
    sums = [2**64 - 1, 0, 12345]
    trailer = encode_trailer(env.transfer_id, mac, sums, SECRET)
    assert decode_trailer(trailer, env.transfer_id, mac, SECRET) == sums
    other_mac = _envelope(999).encode(SECRET)[1]
    with pytest.raises(TransferRejected):
        decode_trailer(trailer, env.transfer_id, other_mac, SECRET)
    with pytest.raises(TransferRejected):
        Envelope.decode(frame, b"x" * 32)
