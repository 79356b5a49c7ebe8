"""What a transfer must satisfy before the receiver installs it: the envelope against the
reservation it was sent for, then the landed blocks against the trailer's checksums and the
reservation's generation ids. Pure: each check returns or raises ``TransferRejected``
(retryable: the sender may try again into a fresh reservation).
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.transfer import protocol as proto
from shared.transfer.checksum import ALGORITHMS
from shared.transfer.envelope import PROTOCOL_VERSION, Envelope, TransferTicket
from shared.transfer.errors import TransferRejected


def check_envelope(
    ticket: TransferTicket,
    env: Envelope,
    dst: tuple[int, ...],
    *,
    worker_id: str,
    fingerprint_digest: str,
    block_nbytes: int,
    verify_checksums: bool,
) -> None:
    """Check ``env`` against ``ticket`` (whose reserved blocks ``dst`` it fills) and this
    receiver (``worker_id``, model/layout ``fingerprint_digest``, arena ``block_nbytes``),
    before any block is received. Raises TransferRejected naming the first mismatch."""

    def reject(reason: str) -> TransferRejected:
        return TransferRejected(reason, request_id=ticket.request_id, retryable=True)

    if env.version != PROTOCOL_VERSION:
        raise reject(f"protocol version {env.version}")
    if env.transfer_id != ticket.transfer_id or env.request_id != ticket.request_id:
        raise reject("envelope names another transfer")
    if env.dst_worker_id != worker_id:
        raise reject("envelope addressed to another worker")
    if env.fingerprint_digest != fingerprint_digest:
        raise reject("model/layout fingerprint mismatch")
    if (env.token_start, env.token_end) != (ticket.token_start, ticket.token_end):
        raise reject("token range differs from the reservation")
    if env.num_blocks != len(dst) or env.block_nbytes != block_nbytes:
        raise reject("block count or block size differs from the reservation")
    if env.generations != ticket.generations[: len(dst)]:
        raise reject("generation ids differ from the reservation")
    if not proto.segments_valid(env.segments, dst):
        raise reject("segments do not tile the reserved blocks")
    if verify_checksums and not env.has_checksums:
        raise reject("checksums required")
    if verify_checksums and env.checksum_algorithm not in ALGORITHMS:
        raise reject(f"unknown checksum algorithm {env.checksum_algorithm!r}")


def check_landed(
    request_id: str,
    expected: Sequence[int],
    got: Sequence[int] | None,
    sent_generations: Sequence[int],
    generations_now: Sequence[int],
) -> None:
    """Check the landed blocks: their checksums ``got`` (None: not verified) equal the
    trailer's ``expected``, and the reservation's generation ids are still the ones the
    envelope was sent for. Raises TransferRejected."""
    if got is not None and list(expected) != list(got):
        bad = (
            next(i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b)
            if len(expected) == len(got)
            else -1
        )
        raise TransferRejected(
            f"checksum mismatch at logical block {bad}", request_id=request_id, retryable=True
        )
    if tuple(generations_now) != tuple(sent_generations):
        raise TransferRejected(
            "generation ids changed under the reservation", request_id=request_id, retryable=True
        )
