"""Decode role: admission by reservation, atomic KV install, continuous batching, suffixes.

Request life on a decode worker::

    admit (reserve blocks for prompt + max_tokens, post the KV receive)
      -> KV arrives, validated, installed in one step          [receiving -> runnable]
      -> (split only) the stolen suffix runs as a chunked prefill on the installed prefix,
         then the first token is sampled here
      -> decode steps, batched with every other runnable request, tokens streamed
      -> finish: blocks freed                                   [runnable -> gone]

A short prompt routed here directly (``serve_local``) skips the transfer: its whole prompt
is the "suffix" on zero context. Admission and KV intake are in decode_intake.py (a part this
role holds and gives its request table); this file has the batch loop, cancellation,
migration out and the ``stats()`` snapshot.

Ownership: the block manager is touched only from the event loop thread. A step running in
the engine thread writes KV only into blocks of requests in that step; a request cancelled
meanwhile is freed after the step commits (``_doomed``), never during it.

A step that raises (CUDA OOM, a device error, a bad id that got past intake) leaves the
engine's state unknown, so the loop does not retry it: every request held here ends at once
with an ``engine_failed`` error item, every block is freed, admission stops, and
``on_engine_failure`` (a constructor argument) tells the runtime, which marks the worker ``failed`` and exits so a
supervisor starts a fresh process (docs/reliability.md, "decode engine failure").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import structlog

from services.worker.config import PREFILL_CHUNK_TOKENS
from services.worker.decode_intake import DecodeIntake
from services.worker.decode_request import DecodeRequest, add_error_item
from services.worker.decode_waiting import WaitingAdmissions
from services.worker.stats import DecodeStats, PoolStats
from services.worker.token_stream import TokenStreamer, wire_logprobs
from shared.engine.batch import StepInput
from shared.engine.engine import SampleSpec
from shared.engine.interface import StepEngine
from shared.engine.logprobs import PromptLogprobsSpec, StepOutput, prompt_spec
from shared.engine.sequence import finish_reason_after
from shared.errors import NoFreeBlocksError
from shared.messages import TokenItem
from shared.transfer.receiver import KVReceiver

log = structlog.get_logger(__name__)

_MAX_REMEMBERED_IDS = 4096  # bounded memory of migrated / early-cancelled request ids


class DecodeRole:
    """Owns the decode-side request table and the decode loop of one worker."""

    def __init__(
        self,
        engine: StepEngine,
        receiver: KVReceiver,
        streamer: TokenStreamer,
        executor: Executor,
        publish: Callable[[], Any],
        *,
        transfer_timeout_s: float,
        max_num_seqs: int,
        prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS,
        decode_reserve_tokens: int = 256,
        suffix_allowance: Callable[[DecodeStats, int, bool], int] | None = None,
        chunk_budget: Callable[[int, bool], int] | None = None,
        observe_stage: Callable[[str, float], None] = lambda _stage, _s: None,
        observe_step: Callable[[int, int, int, float], None] = lambda *_a: None,
        on_engine_failure: Callable[[BaseException], None] = lambda _exc: None,
    ) -> None:
        """``suffix_allowance`` (the policy's re-check of a proposed split, given this
        role's stats) and ``chunk_budget`` (prompt tokens one iteration may carry) are None
        without FluidToken. ``on_engine_failure`` is called once, after a failed step has
        ended every request here (see the module doc)."""
        self.engine = engine
        self.bm = engine.block_manager
        self.streamer = streamer
        self.executor = executor
        self._publish = publish
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.capacity_failures_total = 0
        self.chunk_budget = chunk_budget
        self.requests: dict[str, DecodeRequest] = {}
        self.migrated_to: dict[str, str] = {}  # request id -> peer that now decodes it
        self._cancelled: dict[str, None] = {}  # ids cancelled before their admit arrived
        self.runnable: list[DecodeRequest] = []
        self._in_step: set[str] = set()
        self._doomed: set[str] = set()
        self.wakeup = asyncio.Event()
        self.step_done = asyncio.Event()  # pulsed after every committed step
        self.progress = asyncio.Event()  # set when a request leaves (a D->P drain waits)
        self.stolen_tokens_total = 0
        self.waiting = WaitingAdmissions()  # refused admits their prefill workers retry
        self.migrations_out_total = 0
        self.iterations_total = 0
        self.last_step_s = 0.0
        self.last_batch_size = 0
        self.last_context_tokens = 0
        self.observe_step = observe_step
        self.on_engine_failure = on_engine_failure
        self.engine_failed = False
        self._suffix_allowance = suffix_allowance
        self.intake = DecodeIntake(
            engine,
            receiver,
            streamer,
            publish,
            requests=self.requests,
            runnable=self.runnable,
            cancelled=self._cancelled,
            waiting=self.waiting,
            wakeup=self.wakeup,
            finish=self._finish,
            observe_stage=observe_stage,
            suffix_budget=self._suffix_budget if suffix_allowance is not None else None,
            transfer_timeout_s=transfer_timeout_s,
            max_num_seqs=max_num_seqs,
            decode_reserve_tokens=decode_reserve_tokens,
        )
        # Entry points (the runtime's handlers): the intake's.
        self.admit = self.intake.admit
        self.admit_migration = self.intake.admit_migration
        self.serve_local = self.intake.serve_local

    def _suffix_budget(self, context_tokens: int, forced: bool) -> int:
        assert self._suffix_allowance is not None  # only given to the intake with one
        return self._suffix_allowance(self.stats(), context_tokens, forced)

    @property
    def admitting(self) -> bool:
        return self.intake.admitting

    def set_admitting(self, admitting: bool) -> None:
        """Admit decode work (True) or refuse it (a drain, a failure). Mutates."""
        self.intake.admitting = admitting

    def _stream_error(self, req: DecodeRequest, error: str, code: str) -> None:
        add_error_item(self.streamer, req, error, code)
        self._publish()

    # ------------------------------------------------------------ migration out
    async def freeze(self, request_id: str) -> DecodeRequest | None:
        """Take a runnable request out of the batch at a step boundary (for migration)."""
        req = self.requests.get(request_id)
        if req is None or req.phase != "runnable":
            return None
        req.migrating = True
        while request_id in self._in_step:
            await self.step_done.wait()
        return req if request_id in self.requests else None

    def unfreeze(self, req: DecodeRequest) -> None:
        req.migrating = False
        if req.request_id in self._doomed:
            self._doomed.discard(req.request_id)
            self._finish(req)
            return
        self.wakeup.set()

    def migrated(self, req: DecodeRequest, peer_id: str) -> None:
        """The peer installed the request: drop it here (no finish item: it goes on there)."""
        self._doomed.discard(req.request_id)
        self.migrated_to[req.request_id] = peer_id
        self.migrations_out_total += 1
        while len(self.migrated_to) > _MAX_REMEMBERED_IDS:  # bounded: oldest first
            self.migrated_to.pop(next(iter(self.migrated_to)))
        self._finish(req)

    def fail_frozen(self, req: DecodeRequest, error: str, code: str) -> None:
        """End a frozen request whose migration outcome is unknown: error item, blocks
        freed here, never resumed (the peer may hold it; migration.py cancels it there)."""
        self._doomed.discard(req.request_id)
        self._stream_error(req, error, code)
        self._finish(req)

    # --------------------------------------------------------------------- cancel
    def cancel(self, request_id: str) -> bool:
        """Stop ``request_id`` and free its blocks (after the running step, if in one)."""
        self.waiting.drop(request_id)
        req = self.requests.get(request_id)
        if req is None:
            # Cancel and admit travel on different subjects, so a cancel can overtake the
            # admit it cancels (e.g. both queued while this process was stopped): remember
            # it, and refuse that admit when it comes.
            self._cancelled[request_id] = None
            while len(self._cancelled) > _MAX_REMEMBERED_IDS:
                self._cancelled.pop(next(iter(self._cancelled)))
            return request_id in self.migrated_to  # the runtime forwards it to the peer
        if req.phase == "receiving":
            if req.receive_task is not None:
                req.receive_task.cancel()  # the receiver releases the reservation
            self.requests.pop(request_id, None)
            return True
        if request_id in self._in_step or req.migrating:
            self._doomed.add(request_id)  # freed after the step / the migration send
            return True
        self._finish(req)
        return True

    def _finish(self, req: DecodeRequest) -> None:
        self.requests.pop(req.request_id, None)
        self.progress.set()
        if req in self.runnable:
            self.runnable.remove(req)
        if self.bm.has_sequence(req.request_id):
            self.bm.free_sequence(req.request_id)

    # ----------------------------------------------------------------------- loop
    def _plan(
        self,
    ) -> tuple[
        list[StepInput],
        list[SampleSpec | None],
        list[PromptLogprobsSpec | None],
        list[DecodeRequest],
    ]:
        steps: list[StepInput] = []
        specs: list[SampleSpec | None] = []
        pspecs: list[PromptLogprobsSpec | None] = []
        reqs: list[DecodeRequest] = []
        stalled: list[DecodeRequest] = []
        # Prompt-chunk tokens (stolen suffixes, local prompts) this iteration may carry: the
        # TPOT-safe chunk on the first chunk's prefix (eq. 16) when the policy provides it —
        # 0 when there is no slack while others decode (no minimum chunk).
        prefill_budget: int | None = None if self.chunk_budget else self.prefill_chunk_tokens
        for req in self.runnable:
            if req.migrating:
                continue
            seq = req.seq
            pending = seq.pending_token_ids()
            if len(pending) > 1:  # a suffix or a local prompt: chunked prefill
                if prefill_budget is None and self.chunk_budget is not None:
                    decoding = any(
                        len(r.seq.pending_token_ids()) <= 1
                        for r in self.runnable
                        if not r.migrating
                    )
                    prefill_budget = self.chunk_budget(seq.num_cached_tokens, decoding)
                if not prefill_budget or prefill_budget <= 0:
                    continue
                chunk = pending[:prefill_budget]
                prefill_budget -= len(chunk)
            else:
                chunk = pending
            if not self._ensure_room(req, seq.num_cached_tokens + len(chunk)):
                stalled.append(req)
                continue
            table = self.bm.block_table(req.request_id)
            steps.append(StepInput(req.request_id, chunk, seq.num_cached_tokens, table))
            done = seq.num_cached_tokens + len(chunk) == seq.num_tokens
            specs.append(
                SampleSpec(seq.params, len(seq.output_token_ids), seq.seed) if done else None
            )
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
        if stalled and not steps:
            # Every runnable request needs a block and none is free: the pool cannot make
            # progress. End the newest one clearly (its blocks free the others).
            victim = max(stalled, key=lambda r: r.arrival_s)
            self.capacity_failures_total += 1
            log.warning(
                "kv_pool_exhausted",
                request_id=victim.request_id,
                free_blocks=self.bm.num_free_blocks,
            )
            self._stream_error(
                victim, "KV capacity exhausted while decoding", "kv_capacity_exhausted"
            )
            self._finish(victim)
            # Its blocks are free now: plan again at once. (Returning nothing would let the
            # loop clear its wake-up and sleep with runnable requests: a hang.)
            return self._plan()
        return steps, specs, pspecs, reqs

    def _ensure_room(self, req: DecodeRequest, num_tokens: int) -> bool:
        """Grow ``req``'s block table to hold ``num_tokens``; False if the pool is short."""
        if self.bm.num_tokens(req.request_id) >= num_tokens:
            return True
        try:
            self.bm.grow(req.request_id, num_tokens)
        except NoFreeBlocksError:
            return False
        return True

    async def run(self) -> None:
        """The decode loop. Runs until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            await self.wakeup.wait()
            steps, specs, pspecs, reqs = self._plan()
            if not steps:
                self.wakeup.clear()
                continue
            self._in_step = {r.request_id for r in reqs}
            started = time.perf_counter()
            try:
                out = await loop.run_in_executor(
                    self.executor, self.engine.step_full, steps, specs, pspecs
                )
            except Exception as exc:
                self._in_step = set()
                self._fail_all(exc, len(reqs))
                return
            finally:
                self._in_step = set()
            self.iterations_total += 1
            self.last_step_s = time.perf_counter() - started
            self.last_batch_size = sum(1 for s in steps if s.num_new_tokens == 1)
            self.last_context_tokens = sum(s.context_len for s in steps)
            decode_steps = [s for s in steps if s.num_new_tokens == 1]
            self.observe_step(
                len(decode_steps),
                sum(s.context_len for s in decode_steps),
                sum(s.num_new_tokens for s in steps if s.num_new_tokens > 1),
                self.last_step_s,
            )
            self._commit(steps, out, pspecs, reqs)
            self._publish()
            self.step_done.set()
            self.step_done.clear()

    def _fail_all(self, exc: Exception, batch_size: int) -> None:
        """The engine raised: end every request held here with a clear error and free its
        blocks (a receive is cancelled: its reservation is freed by the receiver once UCX
        lets go), stop admitting, then report to the runtime. Mutates the request table."""
        self.engine_failed = True
        self.set_admitting(False)
        # The exception's type and a bounded message only: never token ids or prompt text.
        log.error(
            "engine_step_failed",
            error=type(exc).__name__,
            detail=str(exc)[:200],
            batch_size=batch_size,
            requests=len(self.requests),
        )
        message = (
            f"the decode worker's engine failed ({type(exc).__name__}) while serving this "
            "request; retry"
        )
        for req in list(self.requests.values()):
            self._stream_error(req, message, "engine_failed")
            if req.phase == "receiving":
                if req.receive_task is not None:
                    req.receive_task.cancel()
                self.requests.pop(req.request_id, None)
            else:
                self._finish(req)
        self._doomed.clear()
        self.progress.set()
        self.on_engine_failure(exc)

    def _commit(
        self,
        steps: list[StepInput],
        out: StepOutput,
        pspecs: list[PromptLogprobsSpec | None],
        reqs: list[DecodeRequest],
    ) -> None:
        now = time.time()
        for i, (step, tok, req) in enumerate(zip(steps, out.tokens, reqs, strict=True)):
            seq = req.seq
            start_pos = seq.num_cached_tokens
            seq.num_cached_tokens = step.context_len
            if req.request_id in self._doomed:
                self._doomed.discard(req.request_id)
                self._finish(req)
                continue
            prompt_lps = wire_logprobs(out.prompt_logprobs[i]) if pspecs[i] is not None else ()
            if tok is None:
                if prompt_lps:  # a mid-prompt chunk: its prompt logprobs go now
                    self.streamer.add(
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
                self.stolen_tokens_total += req.stolen_tokens
            index = len(seq.output_token_ids)
            seq.output_token_ids.append(tok)
            seq.finish_reason = finish_reason_after(
                seq, tok, self.engine.eos_token_ids, self.engine.max_model_len
            )
            stamps = {}
            if index == 0:
                stamps = {**req.timestamps, "first_token_s": now}
            self.streamer.add(
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
                self._finish(req)

    # ---------------------------------------------------------------- snapshots
    def drained(self) -> bool:
        """True when no request is held here (a D->P switch waits for it)."""
        return not self.requests

    def long_running(self, min_remaining_s: float) -> list[str]:
        """Runnable requests expected to need longer than ``min_remaining_s`` to finish at
        the last step time (a D->P switch migrates them)."""
        step_s = max(self.last_step_s, 1e-3)
        return [
            req.request_id
            for req in self.runnable
            if (req.seq.params.max_tokens - len(req.seq.output_token_ids)) * step_s
            > min_remaining_s
        ]

    def stats(self) -> DecodeStats:
        bm = self.bm
        waiting = self.waiting.totals(time.monotonic())
        return DecodeStats(
            pool=PoolStats(
                bm.block_size, bm.num_free_blocks, bm.num_usable_blocks, bm.num_reserved_blocks
            ),
            max_num_seqs=self.max_num_seqs,
            num_requests=len(self.requests),
            num_running=self.num_running,
            num_receiving=self.num_receiving,
            running_kv_tokens=sum(r.seq.num_tokens for r in self.runnable),
            pending_prompt_tokens=self.pending_prompt_tokens(),
            waiting_requests=waiting.requests,
            waiting_kv_tokens=waiting.kv_tokens,
            stolen_tokens_total=self.stolen_tokens_total,
            refused_steals_total=self.intake.refused_steals_total,
            migrations_in_total=self.intake.migrations_in_total,
            migrations_out_total=self.migrations_out_total,
            iterations_total=self.iterations_total,
        )

    # ------------------------------------------------------------------ telemetry
    def pending_prompt_tokens(self) -> int:
        """Prompt tokens accepted here (stolen suffixes, local prompts) not yet computed."""
        total = 0
        for req in self.requests.values():
            if req.phase == "receiving":
                total += len(req.suffix_token_ids)
            else:
                pending = req.seq.num_tokens - req.seq.num_cached_tokens
                total += pending if pending > 1 else 0
        return total

    @property
    def num_running(self) -> int:
        return len(self.runnable)

    @property
    def num_receiving(self) -> int:
        return len(self.requests) - len(self.runnable)
