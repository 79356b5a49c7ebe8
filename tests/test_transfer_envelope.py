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


def test_checksum_algorithm_travels_sealed_and_defaults_to_xxh3() -> None:
    from dataclasses import replace

    from shared.transfer.envelope import seal

    env = replace(_envelope(4), checksum_algorithm="fold64")
    decoded, _ = Envelope.decode(env.encode(SECRET)[0], SECRET)
    assert decoded.checksum_algorithm == "fold64"
    # An envelope from a sender that predates the field means xxh3_64.
    fields = {k: v for k, v in _shallow(_envelope(4)).items() if k != "checksum_algorithm"}
    old, _ = Envelope.decode(seal("envelope", fields, SECRET)[0], SECRET)
    assert old.checksum_algorithm == "xxh3_64"


def test_receiver_rejects_an_unknown_checksum_algorithm() -> None:
    """The name is checked before any block is received (receive_checks.check_envelope)."""
    from dataclasses import replace

    from shared.engine.kv_arena import KVArena
    from shared.transfer import KVFingerprint, TransferTicket
    from shared.transfer.receive_checks import check_envelope

    arena = KVArena(8, 1, 1, 8, 16)
    fp = KVFingerprint("a", "w", "float32", 16, arena.layout)
    ticket = TransferTicket(1 << 20, "r", "d0", b"a", "h", (0, 1), (0, 0), 0, 32, 16, 1024)
    env = replace(
        _envelope(2),
        fingerprint_digest=fp.digest(),
        token_end=32,
        block_nbytes=arena.block_nbytes,
        generations=(0, 0),
        segments=((0, 2),),
    )
    receiver = {
        "worker_id": "d0",
        "fingerprint_digest": fp.digest(),
        "block_nbytes": arena.block_nbytes,
        "verify_checksums": True,
    }
    check_envelope(ticket, env, (0, 1), **receiver)  # the same envelope, named right, passes
    with pytest.raises(TransferRejected, match="unknown checksum algorithm 'crc32'"):
        check_envelope(ticket, replace(env, checksum_algorithm="crc32"), (0, 1), **receiver)
    with pytest.raises(TransferRejected, match="addressed to another worker"):
        check_envelope(ticket, env, (0, 1), **{**receiver, "worker_id": "d1"})


def test_landed_blocks_are_checked_against_trailer_and_generations() -> None:
    from shared.transfer.receive_checks import check_landed

    check_landed("r", [1, 2], [1, 2], (0, 0), (0, 0))
    check_landed("r", [1, 2], None, (0, 0), (0, 0))  # checksums not verified
    with pytest.raises(TransferRejected, match="checksum mismatch at logical block 1"):
        check_landed("r", [1, 2], [1, 3], (0, 0), (0, 0))
    with pytest.raises(TransferRejected, match="checksum mismatch at logical block -1"):
        check_landed("r", [1, 2], [1], (0, 0), (0, 0))
    with pytest.raises(TransferRejected, match="generation ids changed"):
        check_landed("r", [1, 2], [1, 2], (0, 0), (0, 1))


def _shallow(env: Envelope) -> dict:
    from dataclasses import fields

    out = {f.name: getattr(env, f.name) for f in fields(env)}
    out["meta"] = dict(env.meta)
    return out
