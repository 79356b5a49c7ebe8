"""What one forward pass computes: a flattened, variable-length batch over paged KV.

Every forward mode is the same call with different inputs:

- prefill: ``start_pos = 0``, ``token_ids`` = the whole prompt;
- chunked prefill on existing context (a stolen suffix, or a prompt split in chunks):
  ``start_pos = L_ctx`` (tokens already in the KV cache), ``token_ids`` = the next chunk;
- decode: ``token_ids`` = the one last sampled token, ``start_pos`` = tokens already cached.

Sequences of different kinds mix freely in one batch (continuous batching).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepInput:
    """One sequence's share of a forward pass.

    ``block_table`` must already cover ``start_pos + len(token_ids)`` tokens (the caller
    grows it through the BlockManager first). The KV of the new tokens is written into it.
    """

    seq_id: str
    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class SeqSpan:
    """Where one sequence's tokens sit in the flattened batch, and its KV blocks."""

    q_start: int
    q_len: int
    context_len: int
    block_table: torch.Tensor  # int64 [num_blocks]


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    slot_blocks: torch.Tensor  # int64 [T] block id that receives each new token's KV
    slot_offsets: torch.Tensor  # int64 [T] offset inside that block
    spans: tuple[SeqSpan, ...]
    logits_indices: torch.Tensor  # int64 [B] last new token of each sequence
    all_decode: bool  # every sequence has exactly one new token
    # Pure-decode batches only (else None / 0): built once per step so attention does not
    # rebuild them in each layer.
    decode_tables: torch.Tensor | None = None  # int64 [B, max_blocks], padded with block 0
    decode_max_context_len: int = 0
    decode_mask: torch.Tensor | None = None  # bool [B, 1, 1, max_ctx]; None if all equal
    # What a paged-attention plan depends on, from host lists (reading it never syncs a
    # device): per sequence (q_len, context_len, the block ids its context needs).
    layout_key: tuple[tuple[int, int, tuple[int, ...]], ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_batch(steps: Sequence[StepInput], block_size: int, device: torch.device) -> ForwardBatch:
    """Flatten ``steps`` into tensors. Raises ValueError on an inconsistent step."""
    if not steps:
        raise ValueError("empty batch")
    ids: list[int] = []
    positions: list[int] = []
    slot_blocks: list[int] = []
    slot_offsets: list[int] = []
    spans: list[SeqSpan] = []
    last: list[int] = []
    layout: list[tuple[int, int, tuple[int, ...]]] = []
    for step in steps:
        n = step.num_new_tokens
        if n <= 0:
            raise ValueError(f"{step.seq_id}: no new tokens")
        ctx = step.context_len
        if len(step.block_table) * block_size < ctx:
            raise ValueError(f"{step.seq_id}: block table too short for {ctx} tokens")
        q_start = len(ids)
        ids.extend(step.token_ids)
        for pos in range(step.start_pos, ctx):
            positions.append(pos)
            slot_blocks.append(step.block_table[pos // block_size])
            slot_offsets.append(pos % block_size)
        needed = -(-ctx // block_size)
        table = tuple(step.block_table[:needed])
        layout.append((n, ctx, table))
        spans.append(
            SeqSpan(
                q_start,
                n,
                ctx,
                torch.tensor(table, dtype=torch.long, device=device),
            )
        )
        last.append(q_start + n - 1)

    def t(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.long, device=device)

    all_decode = all(s.num_new_tokens == 1 for s in steps)
    decode_tables = None
    decode_mask = None
    max_ctx = 0
    if all_decode:
        lens = [s.context_len for s in steps]
        max_ctx = max(lens)
        width = max(len(span.block_table) for span in spans)
        rows = [list(s.block_table[: -(-s.context_len // block_size)]) for s in steps]
        padded = [r + [0] * (width - len(r)) for r in rows]
        decode_tables = torch.tensor(padded, dtype=torch.long, device=device)
        if min(lens) != max_ctx:
            decode_mask = (torch.arange(max_ctx)[None, :] < torch.tensor(lens)[:, None]).to(device)
            decode_mask = decode_mask[:, None, None, :]
    return ForwardBatch(
        input_ids=t(ids),
        positions=t(positions),
        slot_blocks=t(slot_blocks),
        slot_offsets=t(slot_offsets),
        spans=tuple(spans),
        logits_indices=t(last),
        all_decode=all_decode,
        decode_tables=decode_tables,
        decode_max_context_len=max_ctx,
        decode_mask=decode_mask,
        layout_key=tuple(layout),
    )
