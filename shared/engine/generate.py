"""Single-process generation: the ground truth every distributed path must reproduce.

A small continuous-batching loop over one Engine: each iteration computes up to
``prefill_chunk_tokens`` prompt tokens (several short prompts, or one chunk of a long one:
chunked prefill) and decodes every running sequence, all in one forward pass. When the KV pool runs short the
newest running sequence is preempted (its blocks freed, recomputed later) — never a crash.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from shared.engine.batch import StepInput
from shared.engine.engine import Engine, SampleSpec
from shared.engine.logprobs import Logprob, prompt_spec
from shared.engine.sequence import Sequence, finish_reason_after
from shared.errors import NoFreeBlocksError
from shared.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerationOutput:
    seq_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    # When the params ask: one per output token; prompt ones per prompt token (first None).
    logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob | None] = field(default_factory=list)


def generate(
    engine: Engine,
    prompts: Seq[Seq[int]],
    params: SamplingParams | Seq[SamplingParams],
    prefill_chunk_tokens: int = 512,
) -> list[GenerationOutput]:
    """Generate for every prompt (token ids); outputs in input order.

    Raises ContextLengthError for a prompt that cannot fit, NoFreeBlocksError if a single
    prompt cannot fit the whole KV pool. Frees every block it allocated before returning.
    """
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    seqs = [
        Sequence(f"gen-{i}", list(p), sp)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    by_id = {s.seq_id: s for s in seqs}
    logprobs: dict[str, list[Logprob]] = {s.seq_id: [] for s in seqs}
    # A preempted prompt is recomputed: keep the first score of each position.
    prompt_lps: dict[str, dict[int, Logprob]] = {s.seq_id: {} for s in seqs}
    bm = engine.block_manager
    for s in seqs:
        engine.check_prompt(len(s.prompt_token_ids))
        if bm.blocks_for_tokens(len(s.prompt_token_ids) + 1) > bm.num_usable_blocks:
            raise NoFreeBlocksError(
                bm.blocks_for_tokens(len(s.prompt_token_ids) + 1), bm.num_usable_blocks
            )
    waiting: deque[Sequence] = deque(seqs)
    prefilling: list[Sequence] = []  # admitted, prompt not fully computed yet
    running: list[Sequence] = []
    try:
        while waiting or running or prefilling:
            steps: list[StepInput] = []
            sampled: list[Sequence] = []
            # Prefill: continue admitted prompts, then admit waiting ones, within one token
            # budget per iteration (several short prompts share one forward, as in vLLM).
            # Admission comes second, so a newcomer never takes blocks an older prompt needs.
            budget = prefill_chunk_tokens
            short = False
            for seq in prefilling:
                chunk = seq.pending_token_ids()[:budget]
                if not chunk:
                    break
                try:
                    bm.grow(seq.seq_id, seq.num_cached_tokens + len(chunk))
                except NoFreeBlocksError:
                    short = True
                    break
                budget -= len(chunk)
                steps.append(
                    StepInput(seq.seq_id, chunk, seq.num_cached_tokens, bm.block_table(seq.seq_id))
                )
                if seq.num_cached_tokens + len(chunk) == seq.num_tokens:
                    sampled.append(seq)
            if short:
                # Make room and retry the iteration: the newest running sequence goes first,
                # then the newest admitted prompt (never the oldest: it always progresses).
                if running:
                    _preempt(engine, running, waiting)
                elif len(prefilling) > 1:
                    _preempt(engine, prefilling, waiting)
                else:  # cannot happen: every prompt was checked to fit the pool
                    raise NoFreeBlocksError(1, bm.num_free_blocks)
                continue
            while (
                budget > 0
                and waiting
                and len(running) + len(prefilling) < engine.cfg.max_num_seqs
                and bm.can_allocate(bm.blocks_for_tokens(min(waiting[0].num_tokens, budget)))
            ):
                seq = waiting.popleft()
                chunk = seq.pending_token_ids()[:budget]
                bm.allocate(seq.seq_id, len(chunk))
                prefilling.append(seq)
                budget -= len(chunk)
                steps.append(StepInput(seq.seq_id, chunk, 0, bm.block_table(seq.seq_id)))
                if len(chunk) == seq.num_tokens:
                    sampled.append(seq)
            for seq in list(running):
                try:
                    bm.grow(seq.seq_id, seq.num_tokens)
                except NoFreeBlocksError:
                    _preempt(engine, running, waiting)
                    break
            else:
                for seq in running:
                    steps.append(
                        StepInput(
                            seq.seq_id,
                            seq.pending_token_ids(),
                            seq.num_cached_tokens,
                            bm.block_table(seq.seq_id),
                        )
                    )
                    sampled.append(seq)
            if not steps:
                continue
            specs = [
                SampleSpec(s.params, len(s.output_token_ids), s.seed) if s in sampled else None
                for s in (by_id[st.seq_id] for st in steps)
            ]
            pspecs = [
                prompt_spec(
                    by_id[st.seq_id].prompt_token_ids,
                    st.start_pos,
                    st.num_new_tokens,
                    by_id[st.seq_id].params.prompt_logprobs,
                )
                for st in steps
            ]
            out = engine.step_full(steps, specs, pspecs)
            for step, plps in zip(steps, out.prompt_logprobs, strict=True):
                by_id[step.seq_id].num_cached_tokens = step.context_len
                for j, plp in enumerate(plps):
                    prompt_lps[step.seq_id].setdefault(step.start_pos + 1 + j, plp)
            for step, tok, lp in zip(steps, out.tokens, out.logprobs, strict=True):
                if tok is None:
                    continue
                seq = by_id[step.seq_id]
                seq.output_token_ids.append(tok)
                if lp is not None:
                    logprobs[seq.seq_id].append(lp)
                seq.finish_reason = finish_reason_after(
                    seq, tok, engine.eos_token_ids, engine.max_model_len
                )
                if seq in prefilling:
                    prefilling.remove(seq)
                    running.append(seq)
                if seq.finished:
                    running.remove(seq)
                    bm.free_sequence(seq.seq_id)
    finally:
        for s in seqs:
            if bm.has_sequence(s.seq_id):
                bm.free_sequence(s.seq_id)
    return [
        GenerationOutput(
            s.seq_id,
            s.prompt_token_ids,
            s.output_token_ids,
            s.finish_reason or "abort",
            logprobs[s.seq_id],
            [None, *(prompt_lps[s.seq_id].get(i) for i in range(1, len(s.prompt_token_ids)))]
            if s.params.prompt_logprobs is not None
            else [],
        )
        for s in seqs
    ]


def _preempt(engine: Engine, running: list[Sequence], waiting: deque[Sequence]) -> None:
    """Free the newest sequence of ``running`` and requeue it first (it recomputes its
    tokens). Mutates both lists and the block manager."""
    victim = running.pop()
    engine.block_manager.free_sequence(victim.seq_id)
    victim.num_cached_tokens = 0
    waiting.appendleft(victim)
