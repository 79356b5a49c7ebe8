"""One decode iteration, planned and committed: which requests run and with how many tokens
(continuous batching with chunked suffixes, the policy's TPOT-safe chunk budget), and what
a finished step does to them (tokens streamed, finished requests ended).

Functions over the decode role's table, which ``DecodeRole`` (decode_role.py) owns and
passes in; event loop only (the step itself runs in the engine thread between the two).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from services.worker.decode.decode_request import DecodeRequest
from services.worker.token_stream import TokenStreamer, wire_logprobs
from shared.engine.batch import StepInput
from shared.engine.block_manager import BlockManager
from shared.engine.engine import SampleSpec
from shared.engine.interface import StepEngine
from shared.engine.logprobs import PromptLogprobsSpec, StepOutput, prompt_spec
from shared.engine.sequence import finish_reason_after
from shared.errors import NoFreeBlocksError
from shared.messages import TokenItem


@dataclass(frozen=True, slots=True)
class StepPlan:
    steps: list[StepInput]
    specs: list[SampleSpec | None]  # sample a token (the request's last pending token runs)
    pspecs: list[PromptLogprobsSpec | None]  # score prompt rows computed here
    reqs: list[DecodeRequest]
    stalled: list[DecodeRequest]  # runnable, but its table could not grow


def plan_step(
    runnable: list[DecodeRequest],
    bm: BlockManager,
    chunk_budget: Callable[[int, bool], int] | None,
    prefill_chunk_tokens: int,
) -> StepPlan:
    """The next iteration over ``runnable`` (frozen requests skipped). Grows block tables
    for what it plans (through the block manager); a request it could not grow is in
    ``stalled``. ``chunk_budget`` (the policy's, None without FluidToken) caps the prompt
    tokens the iteration carries; without it, ``prefill_chunk_tokens``."""
    steps: list[StepInput] = []
    specs: list[SampleSpec | None] = []
    pspecs: list[PromptLogprobsSpec | None] = []
    reqs: list[DecodeRequest] = []
    stalled: list[DecodeRequest] = []
    # Prompt-chunk tokens (stolen suffixes, local prompts) this iteration may carry: the
    # TPOT-safe chunk on the first chunk's prefix (eq. 16) when the policy provides it —
    # 0 when there is no slack while others decode (no minimum chunk).
    prefill_budget: int | None = None if chunk_budget else prefill_chunk_tokens
    for req in runnable:
        if req.migrating:
            continue
        seq = req.seq
        pending = seq.pending_token_ids()
        if len(pending) > 1:  # a suffix or a local prompt: chunked prefill
            if prefill_budget is None and chunk_budget is not None:
                decoding = any(
                    len(r.seq.pending_token_ids()) <= 1 for r in runnable if not r.migrating
                )
                prefill_budget = chunk_budget(seq.num_cached_tokens, decoding)
            if not prefill_budget or prefill_budget <= 0:
                continue
            chunk = pending[:prefill_budget]
            prefill_budget -= len(chunk)
        else:
            chunk = pending
        if not _ensure_room(bm, req, seq.num_cached_tokens + len(chunk)):
            stalled.append(req)
            continue
        table = bm.block_table(req.request_id)
        steps.append(StepInput(req.request_id, chunk, seq.num_cached_tokens, table))
        done = seq.num_cached_tokens + len(chunk) == seq.num_tokens
        specs.append(SampleSpec(seq.params, len(seq.output_token_ids), seq.seed) if done else None)
        # Prompt rows computed here (a suffix, a local prompt) are scored here.
        pspecs.append(
            prompt_spec(
                seq.prompt_token_ids,
                seq.num_cached_tokens,
                len(chunk),
                seq.params.prompt_logprobs,
            )
        )
        reqs.append(req)
    return StepPlan(steps, specs, pspecs, reqs, stalled)


def _ensure_room(bm: BlockManager, req: DecodeRequest, num_tokens: int) -> bool:
    """Grow ``req``'s block table to hold ``num_tokens``; False if too few blocks are free."""
    if bm.num_tokens(req.request_id) >= num_tokens:
        return True
    try:
        bm.grow(req.request_id, num_tokens)
    except NoFreeBlocksError:
        return False
    return True


def commit_step(
    plan: StepPlan,
    out: StepOutput,
    *,
    streamer: TokenStreamer,
    engine: StepEngine,
    doomed: set[str],
    finish: Callable[[DecodeRequest], None],
) -> int:
    """Apply a finished step: advance each sequence, queue its token items, ``finish`` the
    requests that ended or were cancelled during the step (``doomed``, emptied of them).
    Returns the stolen suffix tokens whose prefill completed in this step."""
    steps, pspecs, reqs = plan.steps, plan.pspecs, plan.reqs
    now = time.time()
    stolen = 0
    for i, (step, tok, req) in enumerate(zip(steps, out.tokens, reqs, strict=True)):
        seq = req.seq
        start_pos = seq.num_cached_tokens
        seq.num_cached_tokens = step.context_len
        if req.request_id in doomed:
            doomed.discard(req.request_id)
            finish(req)
            continue
        prompt_lps = wire_logprobs(out.prompt_logprobs[i]) if pspecs[i] is not None else ()
        if tok is None:
            if prompt_lps:  # a mid-prompt chunk: its prompt logprobs go now
                streamer.add(
                    req.tokens_subject,
                    TokenItem(
                        request_id=req.request_id,
                        index=len(seq.output_token_ids),
                        prompt_logprobs_start=start_pos + 1,
                        prompt_logprobs=prompt_lps,
                    ),
                )
            continue
        if step.num_new_tokens > 1 and req.stolen_tokens:
            stolen += req.stolen_tokens
        index = len(seq.output_token_ids)
        seq.output_token_ids.append(tok)
        seq.finish_reason = finish_reason_after(
            seq, tok, engine.eos_token_ids, engine.max_model_len
        )
        stamps = {}
        if index == 0:
            stamps = {**req.timestamps, "first_token_s": now}
        streamer.add(
            req.tokens_subject,
            TokenItem(
                request_id=req.request_id,
                index=index,
                token_ids=(tok,),
                finish_reason=seq.finish_reason,
                timestamps=stamps,
                logprobs=wire_logprobs((out.logprobs[i],)),
                prompt_logprobs_start=start_pos + 1 if prompt_lps else 0,
                prompt_logprobs=prompt_lps,
            ),
        )
        if seq.finished:
            finish(req)
    return stolen
