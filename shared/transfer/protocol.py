"""Wire layout of one transfer: tags, data segments, control-buffer sizes.

A transfer is identified by a 64-bit ``transfer_id`` chosen by the receiver with its low
``TAG_INDEX_BITS`` bits zero. Every message of the transfer uses tag
``transfer_id | index``; control messages take the first indices, data segment ``k`` takes
``SEGMENT_TAG_BASE + k``. The receiver posts its receives on the worker (not on an
endpoint), so a message is matched by tag alone, whichever peer sent it; the per-transfer
random id keeps many concurrent transfers from many peers apart.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection, Sequence

TAG_INDEX_BITS = 20
ENVELOPE_TAG = 0  # sender -> receiver: sealed envelope (first)
TRAILER_TAG = 1  # sender -> receiver: sealed checksum trailer (last)
ABORT_TAG = 2  # sender -> receiver: sealed abort
VERDICT_TAG = 3  # receiver -> sender: sealed verdict
SEGMENT_TAG_BASE = 16
MAX_SEGMENTS = (1 << TAG_INDEX_BITS) - SEGMENT_TAG_BASE


def new_transfer_id(in_use: Collection[int]) -> int:
    """A random id with the low TAG_INDEX_BITS zero, not in ``in_use``."""
    while True:
        tid = secrets.randbits(64 - TAG_INDEX_BITS) << TAG_INDEX_BITS
        if tid and tid not in in_use:
            return tid


def tag(transfer_id: int, index: int) -> int:
    if not 0 <= index < (1 << TAG_INDEX_BITS):
        raise ValueError(f"tag index {index} out of range")
    return transfer_id | index


def segment_tag(transfer_id: int, segment: int) -> int:
    return tag(transfer_id, SEGMENT_TAG_BASE + segment)


def plan_segments(
    src_ids: Sequence[int], dst_ids: Sequence[int], max_blocks: int | None = None
) -> list[tuple[int, int]]:
    """Split logical blocks into messages: runs contiguous on BOTH sides, at most
    ``max_blocks`` long.

    Returns ``(first logical index, num blocks)`` in order. Each segment is one contiguous
    byte range in the sender's arena and one in the receiver's, so it moves as a single
    UCX message with no staging copy on either side.
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError("source and destination block lists differ in length")
    segments: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(src_ids) + 1):
        if (
            i == len(src_ids)
            or src_ids[i] != src_ids[i - 1] + 1
            or dst_ids[i] != dst_ids[i - 1] + 1
            or (max_blocks is not None and i - start >= max_blocks)
        ):
            segments.append((start, i - start))
            start = i
    if len(segments) > MAX_SEGMENTS:
        raise ValueError(f"{len(segments)} segments exceed the tag space")
    return segments


def segments_valid(segments: Sequence[tuple[int, int]], dst_ids: Sequence[int]) -> bool:
    """True iff ``segments`` tile ``range(len(dst_ids))`` in order, each contiguous in dst."""
    pos = 0
    for first, count in segments:
        if first != pos or count <= 0 or first + count > len(dst_ids):
            return False
        if dst_ids[first + count - 1] - dst_ids[first] != count - 1:
            return False
        if any(dst_ids[j + 1] != dst_ids[j] + 1 for j in range(first, first + count - 1)):
            return False
        pos += count
    return pos == len(dst_ids) and len(segments) <= MAX_SEGMENTS


def envelope_capacity(num_blocks: int) -> int:
    """Receive-buffer bytes that always hold an envelope for ``num_blocks`` blocks."""
    return 8192 + 4096 + 40 * num_blocks


def trailer_capacity(num_blocks: int) -> int:
    return 512 + 8 * num_blocks


CONTROL_CAPACITY = 1024  # abort and verdict frames
