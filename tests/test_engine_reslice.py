"""Re-slicing the arena at a role switch: the prefill workspace is carved from the KV pool's
tail, prompt chunks gather their context into it with results identical to fresh memory, and
the decode role gets every block back (zeroed when ``kv_zero_on_free`` is on)."""

from __future__ import annotations

import random

import pytest
import torch

from shared.engine.batch import StepInput
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.errors import BlockStateError

BLOCK = 4
NUM_BLOCKS = 256


def _engine() -> Engine:
    return Engine.load(
        EngineConfig(model="tiny", block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, kv_zero_on_free=True)
    )


def _chunked_logits(engine: Engine, ids: list[int], split: int) -> torch.Tensor:
    """Prefill ``ids`` in two chunks (the second gathers the first's KV as context)."""
    table = list(range(-(-len(ids) // BLOCK)))
    engine.forward([StepInput("s", ids[:split], 0, table)])
    return engine.forward([StepInput("s", ids[split:], split, table)])[0]


def test_prefill_role_lends_the_tail_and_decode_takes_it_back() -> None:
    eng = _engine()
    bm = eng.block_manager
    attn = eng.model.attention
    lent = eng.reslice("prefill")
    # tiny: one layer's K+V over 1024 positions = 256 KiB = 128 blocks of 2 KiB, capped at
    # 1/8 of the pool (32 blocks: a workspace for contexts up to 256 tokens).
    assert lent == 32
    assert bm.lent_blocks == range(NUM_BLOCKS - 32, NUM_BLOCKS)
    assert (bm.num_usable_blocks, bm.num_free_blocks) == (NUM_BLOCKS - 32, NUM_BLOCKS - 32)
    ws = attn.workspace  # type: ignore[attr-defined]
    assert ws is not None
    assert ws.data_ptr() == eng.arena.run_bytes(NUM_BLOCKS - 32, 32).data_ptr()
    assert eng.reslice("prefill") == 32  # idempotent
    bm.check_integrity()

    ids = [random.Random(1).randrange(3, eng.model_config.vocab_size) for _ in range(90)]
    _chunked_logits(eng, ids, 50)
    assert torch.count_nonzero(eng.arena.run_bytes(NUM_BLOCKS - 32, 32)) > 0  # it was used

    assert eng.reslice("decode") == 0
    assert attn.workspace is None  # type: ignore[attr-defined]
    assert (bm.num_usable_blocks, bm.lent_blocks) == (NUM_BLOCKS, range(NUM_BLOCKS, NUM_BLOCKS))
    # kv_zero_on_free: gathered KV (user data) never reaches a decode request's blocks.
    assert torch.count_nonzero(eng.arena.run_bytes(NUM_BLOCKS - 32, 32)) == 0
    bm.check_integrity()


@pytest.mark.parametrize(("length", "split"), [(37, 20), (90, 1), (300, 299), (600, 250)])
def test_gathering_into_the_workspace_equals_fresh_memory(length: int, split: int) -> None:
    """Contexts that fit the workspace (<= 256 tokens here) and longer ones (fallback)."""
    plain, sliced = _engine(), _engine()
    assert sliced.reslice("prefill") > 0
    ids = [random.Random(length).randrange(3, plain.model_config.vocab_size) for _ in range(length)]
    want = _chunked_logits(plain, ids, split)
    got = _chunked_logits(sliced, ids, split)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_reslice_refuses_a_tail_in_use_and_changes_nothing() -> None:
    eng = _engine()
    bm = eng.block_manager
    bm.allocate("everything", NUM_BLOCKS * BLOCK)  # the tail is held by a sequence
    with pytest.raises(BlockStateError):
        eng.reslice("prefill")
    assert eng.model.attention.workspace is None  # type: ignore[attr-defined]
    assert bm.num_usable_blocks == NUM_BLOCKS
    bm.free_sequence("everything")
    bm.check_integrity()
