"""Decode role: continuous batching of installed requests and stolen suffixes, one loop.

Request life on a decode worker::

    admit (reserve blocks for prompt + max_tokens, post the KV receive)
      -> KV arrives, validated, installed in one step          [receiving -> runnable]
      -> (split only) the stolen suffix runs as a chunked prefill on the installed prefix,
         then the first token is sampled here
      -> decode steps, batched with every other runnable request, tokens streamed
      -> finish: blocks freed                                   [runnable -> gone]

A short prompt routed here directly (``serve_local``) skips the transfer: its whole prompt
is the "suffix" on zero context. The request table (cancel, migration out) is
decode_table.py, admission and KV intake decode_intake.py, planning and committing one
iteration decode_step.py; this file has the batch loop, the engine-failure path and the
``stats()`` snapshot.

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
from services.worker.decode.decode_intake import DecodeIntake
from services.worker.decode.decode_step import StepPlan, commit_step, plan_step
from services.worker.decode.decode_table import DecodeTable
from services.worker.stats import DecodeStats, PoolStats
from services.worker.token_stream import TokenStreamer
from shared.engine.interface import StepEngine
from shared.transfer.receiver import KVReceiver

log = structlog.get_logger(__name__)


class DecodeRole:
    """Owns the decode-side request table (``table``) and the decode loop of one worker."""

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
        self.chunk_budget = chunk_budget
        self.table = DecodeTable(self.bm, streamer, publish)
        self.progress = self.table.progress  # set when a request leaves (a D->P drain waits)
        self.stolen_tokens_total = 0
        self.iterations_total = 0
        self.last_step_s = 0.0
        self._observe_step = observe_step
        self._on_engine_failure = on_engine_failure
        self.engine_failed = False
        self._suffix_allowance = suffix_allowance
        self.intake = DecodeIntake(
            engine,
            receiver,
            streamer,
            publish,
            table=self.table,
            observe_stage=observe_stage,
            suffix_budget=self._suffix_budget if suffix_allowance is not None else None,
            transfer_timeout_s=transfer_timeout_s,
            max_num_seqs=max_num_seqs,
            decode_reserve_tokens=decode_reserve_tokens,
        )
        # Entry points (the runtime's handlers): the intake's and the table's.
        self.admit = self.intake.admit
        self.admit_migration = self.intake.admit_migration
        self.serve_local = self.intake.serve_local
        self.cancel = self.table.cancel
        self.take_migrated_peer = self.table.take_migrated_peer
        self.drained = self.table.drained

    def _suffix_budget(self, context_tokens: int, forced: bool) -> int:
        assert self._suffix_allowance is not None  # only given to the intake with one
        return self._suffix_allowance(self.stats(), context_tokens, forced)

    def set_admitting(self, admitting: bool) -> None:
        """Admit decode work (True) or refuse it (a drain, a failure). Mutates."""
        self.intake.admitting = admitting

    # ----------------------------------------------------------------------- loop
    def _plan(self) -> StepPlan:
        table = self.table
        while True:
            plan = plan_step(table.runnable, self.bm, self.chunk_budget, self.prefill_chunk_tokens)
            if not plan.stalled or plan.steps:
                return plan
            # Every runnable request needs a block and none is free: the pool cannot make
            # progress. End the newest one clearly (its blocks free the others), then plan
            # again at once. (Returning nothing would let the loop clear its wake-up and
            # sleep with runnable requests: a hang.)
            victim = max(plan.stalled, key=lambda r: r.arrival_s)
            log.warning(
                "kv_pool_exhausted",
                request_id=victim.request_id,
                free_blocks=self.bm.num_free_blocks,
            )
            table.stream_error(
                victim, "KV capacity exhausted while decoding", "kv_capacity_exhausted"
            )
            table.finish(victim)

    async def run(self) -> None:
        """The decode loop. Runs until cancelled."""
        loop = asyncio.get_running_loop()
        table = self.table
        while True:
            await table.wakeup.wait()
            plan = self._plan()
            steps, reqs = plan.steps, plan.reqs
            if not steps:
                table.wakeup.clear()
                continue
            table.in_step = {r.request_id for r in reqs}
            started = time.perf_counter()
            try:
                out = await loop.run_in_executor(
                    self.executor, self.engine.step_full, steps, plan.specs, plan.pspecs
                )
            except Exception as exc:
                table.in_step = set()
                self._fail_all(exc, len(reqs))
                return
            finally:
                table.in_step = set()
            self.iterations_total += 1
            self.last_step_s = time.perf_counter() - started
            decode_steps = [s for s in steps if s.num_new_tokens == 1]
            self._observe_step(
                len(decode_steps),
                sum(s.context_len for s in decode_steps),
                sum(s.num_new_tokens for s in steps if s.num_new_tokens > 1),
                self.last_step_s,
            )
            self.stolen_tokens_total += commit_step(
                plan,
                out,
                streamer=self.streamer,
                engine=self.engine,
                doomed=table.doomed,
                finish=table.finish,
            )
            self._publish()
            table.step_done.set()
            table.step_done.clear()

    def _fail_all(self, exc: Exception, batch_size: int) -> None:
        """The engine raised: end every request held here with a clear error and free its
        blocks (a receive is cancelled: its reservation is freed by the receiver once UCX
        lets go), stop admitting, then report to the runtime. Mutates the request table."""
        self.engine_failed = True
        self.set_admitting(False)
        table = self.table
        # The exception's type and a bounded message only: never token ids or prompt text.
        log.error(
            "engine_step_failed",
            error=type(exc).__name__,
            detail=str(exc)[:200],
            batch_size=batch_size,
            requests=len(table.requests),
        )
        message = (
            f"the decode worker's engine failed ({type(exc).__name__}) while serving this "
            "request; retry"
        )
        for req in list(table.requests.values()):
            table.stream_error(req, message, "engine_failed")
            if req.phase == "receiving":
                if req.receive_task is not None:
                    req.receive_task.cancel()
                table.requests.pop(req.request_id, None)
            else:
                table.finish(req)
        table.doomed.clear()
        table.progress.set()
        self._on_engine_failure(exc)

    # ---------------------------------------------------------------- snapshots
    def long_running(self, min_remaining_s: float) -> list[str]:
        """Runnable requests expected to need longer than ``min_remaining_s`` to finish at
        the last step time (a D->P switch migrates them)."""
        step_s = max(self.last_step_s, 1e-3)
        return [
            req.request_id
            for req in self.table.runnable
            if (req.seq.params.max_tokens - len(req.seq.output_token_ids)) * step_s
            > min_remaining_s
        ]

    def stats(self) -> DecodeStats:
        bm, table = self.bm, self.table
        waiting = table.waiting.totals(time.monotonic())
        return DecodeStats(
            pool=PoolStats(
                bm.block_size, bm.num_free_blocks, bm.num_usable_blocks, bm.num_reserved_blocks
            ),
            max_num_seqs=self.max_num_seqs,
            num_requests=len(table.requests),
            num_running=table.num_running,
            num_receiving=table.num_receiving,
            running_kv_tokens=sum(r.seq.num_tokens for r in table.runnable),
            pending_prompt_tokens=table.pending_prompt_tokens(),
            waiting_requests=waiting.requests,
            waiting_kv_tokens=waiting.kv_tokens,
            stolen_tokens_total=self.stolen_tokens_total,
            refused_steals_total=self.intake.refused_steals_total,
            migrations_in_total=self.intake.migrations_in_total,
            migrations_in_failed_total=self.intake.migrations_in_failed_total,
            migrations_out_total=table.migrations_out_total,
            iterations_total=self.iterations_total,
            entered_total=table.entered_total,
            left_total=table.left_total,
        )
