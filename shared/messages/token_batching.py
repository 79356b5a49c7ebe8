"""Pack one iteration's token items into TokenBatch messages that always fit the size limit.

The size of each item is bounded arithmetically (an upper bound on its msgpack encoding),
so packing costs no trial encodes and the limit holds by construction: items are added to
a batch while the bound of the batch stays under the budget. Items with more than
MAX_ITEM_TOKENS token ids are split into consecutive items of the same request (the
finish reason and error go on the last piece); over-long error texts are truncated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from shared.messages.common import MAX_ERROR_CHARS
from shared.messages.limits import MAX_MESSAGE_BYTES
from shared.messages.schema import truncate_text
from shared.messages.sequence import StreamSequencer
from shared.messages.streams import MAX_ITEM_TOKENS, MAX_TIMESTAMPS, TokenBatch, TokenItem

# Per-item overhead beyond the field values (array header; a map with field names would
# also fit): generous.
_ITEM_FIXED_BYTES = 96
_STR_HEADER_BYTES = 5
_INT_BYTES = 9
_FLOAT_BYTES = 9
# TokenBatch envelope: field names, publisher_id (<= 128 chars * 4 B), epoch, seq, tag,
# version and the items array header.
_BATCH_ENVELOPE_BYTES = 1024
# One TokenLogprob: array header, the float, two array headers (+ per top entry an id and
# a float).
_LOGPROB_FIXED_BYTES = 3 + _FLOAT_BYTES + 2 * _STR_HEADER_BYTES
# Prompt logprobs per item: 512 x (k = 20) stays ~200 KB, under the message limit.
MAX_PROMPT_LOGPROBS_PER_ITEM = 512


def _str_bound(text: str | None) -> int:
    if text is None:
        return 1
    return _STR_HEADER_BYTES + len(text.encode("utf-8"))


def item_size_bound(item: TokenItem) -> int:
    """An upper bound on the msgpack size of ``item`` inside a TokenBatch. Pure."""
    size = _ITEM_FIXED_BYTES + _str_bound(item.request_id)
    size += _STR_HEADER_BYTES + _INT_BYTES * len(item.token_ids)
    size += _str_bound(item.finish_reason) + _str_bound(item.error) + _str_bound(item.error_code)
    size += _STR_HEADER_BYTES
    for key in item.timestamps:
        size += _str_bound(key) + _FLOAT_BYTES
    size += 2 * _STR_HEADER_BYTES + _INT_BYTES
    for lp in (*item.logprobs, *item.prompt_logprobs):
        size += _LOGPROB_FIXED_BYTES + (_INT_BYTES + _FLOAT_BYTES) * len(lp.top_ids)
    return size


def _normalise(item: TokenItem) -> list[TokenItem]:
    """Split/truncate one item so that each piece passes schema limits."""
    if item.error is not None and len(item.error) > MAX_ERROR_CHARS:
        item = dataclasses.replace(item, error=truncate_text(item.error, MAX_ERROR_CHARS))
    if len(item.timestamps) > MAX_TIMESTAMPS:
        kept = dict(list(item.timestamps.items())[:MAX_TIMESTAMPS])
        item = dataclasses.replace(item, timestamps=kept)
    pieces: list[TokenItem] = []
    plps = item.prompt_logprobs
    if len(plps) > MAX_PROMPT_LOGPROBS_PER_ITEM:
        # Prompt logprobs beyond the first piece travel in items of their own (no tokens).
        n = MAX_PROMPT_LOGPROBS_PER_ITEM
        for start in range(n, len(plps), n):
            pieces.append(
                TokenItem(
                    request_id=item.request_id,
                    index=item.index,
                    prompt_logprobs_start=item.prompt_logprobs_start + start,
                    prompt_logprobs=plps[start : start + n],
                )
            )
        item = dataclasses.replace(item, prompt_logprobs=plps[:n])
    if len(item.token_ids) <= MAX_ITEM_TOKENS:
        return [*pieces, item]
    ids, lps = item.token_ids, item.logprobs
    for start in range(0, len(ids), MAX_ITEM_TOKENS):
        chunk = tuple(ids[start : start + MAX_ITEM_TOKENS])
        chunk_lps = tuple(lps[start : start + MAX_ITEM_TOKENS])
        last = start + MAX_ITEM_TOKENS >= len(ids)
        if last:
            pieces.append(
                dataclasses.replace(
                    item,
                    index=item.index + start,
                    token_ids=chunk,
                    logprobs=chunk_lps,
                    prompt_logprobs=item.prompt_logprobs if start == 0 else (),
                )
            )
        else:
            pieces.append(
                TokenItem(
                    request_id=item.request_id,
                    index=item.index + start,
                    token_ids=chunk,
                    logprobs=chunk_lps,
                    prompt_logprobs_start=item.prompt_logprobs_start if start == 0 else 0,
                    prompt_logprobs=item.prompt_logprobs if start == 0 else (),
                )
            )
    return pieces


def pack_token_batches(
    sequencer: StreamSequencer,
    stream: str,
    items: Iterable[TokenItem],
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> list[TokenBatch]:
    """Pack ``items`` (in order) into as few TokenBatch messages as the size limit allows.

    Each batch gets the next seq of ``stream`` from ``sequencer`` (mutates it). Returns []
    when there are no items. Every returned batch encodes to at most ``max_bytes``.
    """
    budget = max_bytes - _BATCH_ENVELOPE_BYTES
    batches: list[TokenBatch] = []
    current: list[TokenItem] = []
    current_bytes = 0

    def flush() -> None:
        nonlocal current, current_bytes
        if current:
            batches.append(
                TokenBatch(
                    publisher_id=sequencer.publisher_id,
                    epoch=sequencer.epoch,
                    seq=sequencer.next_seq(stream),
                    items=tuple(current),
                )
            )
        current, current_bytes = [], 0

    for raw_item in items:
        for item in _normalise(raw_item):
            size = item_size_bound(item)
            if current and current_bytes + size > budget:
                flush()
            current.append(item)
            current_bytes += size
    flush()
    return batches
