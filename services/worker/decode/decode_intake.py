"""Decode role, intake side: how a request enters a decode worker.

    admit: reserve blocks for prompt + decode horizon, post the KV receive   [receiving]
      -> the KV arrives, validated, installed in one step                   [runnable]

A live migration from a peer arrives the same way (``admit_migration``: the sequence goes
on where it stopped there); a short prompt routed here whole (``serve_local``) skips the
transfer. ``DecodeRole`` (decode_role.py) holds one ``DecodeIntake`` and gives it its request
table (decode_table.py): the table is the role's, the intake adds to it, from the event
loop only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import structlog

from services.worker.decode.decode_request import DecodeRequest
from services.worker.decode.decode_table import DecodeTable
from services.worker.params import engine_params
from services.worker.token_stream import TokenStreamer
from shared.engine.block_manager import BlockManager
from shared.engine.interface import StepEngine
from shared.engine.sequence import Sequence, finish_reason_after
from shared.errors import NoFreeBlocksError
from shared.messages import AdmitReply, AdmitRequest, MigrateRequest, PrefillRequest, TokenItem
from shared.messages import SamplingParams as WireParams
from shared.policy.pressure import admission_kv_tokens
from shared.transfer.errors import TransferError
from shared.transfer.receiver import KVReceiver

log = structlog.get_logger("services.worker.decode.decode_role")


class DecodeIntake:
    """Admission and KV intake for ``DecodeRole``. Adds to the role's table (given here);
    ``admitting`` is switched by the role (``DecodeRole.set_admitting``)."""

    def __init__(
        self,
        engine: StepEngine,
        receiver: KVReceiver,
        streamer: TokenStreamer,
        publish: Callable[[], Any],
        *,
        table: DecodeTable,
        observe_stage: Callable[[str, float], None],
        suffix_budget: Callable[[int, bool], int] | None,
        transfer_timeout_s: float,
        max_num_seqs: int,
        decode_reserve_tokens: int,
    ) -> None:
        self.engine = engine
        self.bm: BlockManager = engine.block_manager
        self.receiver = receiver
        self.streamer = streamer
        self._publish = publish
        self.table = table
        self.observe_stage = observe_stage
        # (context tokens, forced) -> suffix tokens we accept now (the policy's re-check).
        self._suffix_budget = suffix_budget
        self.transfer_timeout_s = transfer_timeout_s
        self.max_num_seqs = max_num_seqs
        self.decode_reserve_tokens = decode_reserve_tokens
        self.admitting = True
        self.refused_steals_total = 0
        self.migrations_in_total = 0
        self.migrations_in_failed_total = 0  # receives of live migrations that failed

    def _blocks_for_request(self, prompt_len: int, max_tokens: int) -> int:
        """Blocks reserved at admission: the prompt plus a decode horizon. Longer outputs
        grow their table while decoding (``_ensure_room``)."""
        total = admission_kv_tokens(
            prompt_len, max_tokens, self.decode_reserve_tokens, self.engine.max_model_len
        )
        return self.bm.blocks_for_tokens(total)

    @staticmethod
    def _sequence(request_id: str, prompt: list[int], sampling: WireParams) -> Sequence:
        """A request's Sequence with the seed the router resolved (so every worker agrees)."""
        seed = sampling.seed if sampling.seed is not None else -1
        return Sequence(request_id, prompt, engine_params(sampling), seed=seed)

    def _reserve(
        self,
        request_id: str,
        prompt_len: int,
        kv_tokens: int,
        sampling: WireParams,
        tokens_subject: str,
    ) -> tuple[DecodeRequest | None, AdmitReply | None]:
        """Reserve blocks for a request whose first ``kv_tokens`` of KV will arrive, and
        post its receive. Returns (request, None), or (None, refusal) when too few blocks
        are free. The prompt's token ids are placeholders: only its KV arrives."""
        try:
            ticket = self.receiver.prepare(
                request_id,
                num_tokens=kv_tokens,
                num_blocks=self._blocks_for_request(prompt_len, sampling.max_tokens),
            )
        except NoFreeBlocksError as exc:
            if exc.needed_blocks > self.bm.num_usable_blocks:  # can never fit: no point retrying
                return None, AdmitReply(ok=False, error=f"request larger than the KV pool: {exc}")
            return None, AdmitReply(ok=False, error=str(exc), retry_after_ms=50)
        seq = self._sequence(request_id, [0] * prompt_len, sampling)
        req = DecodeRequest(request_id, tokens_subject, seq, time.time(), ticket=ticket)
        self.table.requests[request_id] = req
        return req, None

    def _start_receive(self, req: DecodeRequest, suffix_len: int = 0) -> AdmitReply:
        req.receive_task = asyncio.ensure_future(self._receive(req, req.ticket))
        req.receive_task.add_done_callback(lambda _: self._release_unstarted(req))
        return AdmitReply(
            ok=True,
            transfer_id=req.ticket.transfer_id,
            ticket=self.receiver.encode_ticket(req.ticket),  # block ids, generations, address
            suffix_len=suffix_len,
        )

    def admit(self, msg: AdmitRequest) -> AdmitReply:
        """Reserve blocks for ``msg`` and post its KV receive. Never raises for capacity."""
        if not self.admitting:
            return AdmitReply(
                ok=False, error="worker is not admitting decode work", retry_after_ms=0
            )
        if msg.request_id in self.table.requests:
            return AdmitReply(ok=False, error=f"request {msg.request_id} already admitted")
        if msg.request_id in self.table.cancelled:
            return AdmitReply(ok=False, error=f"request {msg.request_id} was cancelled")
        # Requests refused earlier and still waiting are served first (decode_waiting.py).
        ahead = self.table.waiting.ahead(msg.request_id, time.monotonic())
        if len(self.table.requests) + ahead.requests >= self.max_num_seqs:
            # The prefill worker keeps the request waiting (its KV held there) and retries:
            # count it, so that DPI_adm and telemetry show the demand we refused.
            self._note_waiting(msg)
            return AdmitReply(ok=False, error="decode batch is full", retry_after_ms=20)
        if ahead.requests:
            need = self._blocks_for_request(msg.prompt_len, msg.sampling.max_tokens)
            if self.bm.num_free_blocks - self.bm.blocks_for_tokens(ahead.kv_tokens) < need:
                self._note_waiting(msg)
                return AdmitReply(
                    ok=False, error="KV kept for requests waiting longer", retry_after_ms=50
                )
        suffix_len = msg.suffix_len
        if suffix_len and self._suffix_budget is not None:
            allowed = self._suffix_budget(msg.prompt_len - suffix_len, msg.forced_split)
            if suffix_len > allowed:
                # Re-check our own budget: refuse the steal rather than overrun TPOT.
                self.refused_steals_total += 1
                suffix_len = 0
        req, refusal = self._reserve(
            msg.request_id,
            msg.prompt_len,
            msg.prompt_len - suffix_len,
            msg.sampling,
            msg.tokens_subject,
        )
        if req is None:
            assert refusal is not None
            if refusal.retry_after_ms:
                self._note_waiting(msg)
            return refusal
        self.table.waiting.drop(msg.request_id)
        if suffix_len:
            req.suffix_token_ids = tuple(msg.suffix_token_ids)
        return self._start_receive(req, suffix_len)

    def _note_waiting(self, msg: AdmitRequest) -> None:
        kv = admission_kv_tokens(
            msg.prompt_len, msg.max_tokens, self.decode_reserve_tokens, self.engine.max_model_len
        )
        self.table.waiting.note(msg.request_id, kv, time.monotonic())

    def _release_unstarted(self, req: DecodeRequest) -> None:
        """A receive task cancelled before its first step (admit and cancel both queued
        while this process was stopped, then handled in one loop turn) never reached
        ``receiver.receive``, which owns the reservation from its first line: release the
        ticket here, or its blocks stay reserved for good."""
        if not req.receive_started and req.ticket is not None:
            self.receiver.release(req.ticket)

    async def _receive(self, req: DecodeRequest, ticket: Any) -> None:
        req.receive_started = True  # from here on the receiver owns the reservation
        try:
            got = await self.receiver.receive(ticket, timeout_s=self.transfer_timeout_s)
        except TransferError as exc:
            # The receiver has already given the reservation back (its contract).
            self.table.requests.pop(req.request_id, None)
            self.table.progress.set()  # a request left (a drain here re-checks at once)
            if req.migrated_from:
                # The source still holds the request and owns the outcome: it resumes it,
                # moves it on, or ends the stream itself when the outcome is unknown. An
                # error item from here (in the request's custody since the hand-over)
                # would end a stream that still runs there.
                self.migrations_in_failed_total += 1
                log.warning(
                    "migration_in_failed",
                    request_id=req.request_id,
                    source=req.migrated_from,
                    error=str(exc),
                )
                return
            log.warning("kv_receive_failed", request_id=req.request_id, error=str(exc))
            self.table.stream_error(req, f"KV transfer failed: {exc}", exc.code)
            return
        except asyncio.CancelledError:
            self.table.requests.pop(req.request_id, None)
            raise
        if req.request_id not in self.table.requests:  # cancelled while installing
            self.bm.free_sequence(got.seq_id)
            return
        t = got.timings_ms
        self.observe_stage("transfer_queue", t.get("envelope_wait_ms", 0.0) / 1e3)
        self.observe_stage("copy", t.get("data_ms", 0.0) / 1e3)
        self.observe_stage(
            "validation", (t.get("validate_ms", 0.0) + t.get("install_ms", 0.0)) / 1e3
        )
        meta = got.meta
        seq = req.seq
        if "migrated_cached_tokens" in meta:  # a live migration: continue where it left off
            self.migrations_in_total += 1
            seq.num_cached_tokens = int(meta["migrated_cached_tokens"])
            self.table.make_runnable(req)
            return
        prefix_len = int(meta["prefix_len"])
        seq.num_cached_tokens = prefix_len
        suffix = list(req.suffix_token_ids)
        if prefix_len + len(suffix) != len(seq.prompt_token_ids):
            suffix = []  # defensive: a prefix without its suffix cannot be completed
        if suffix:
            seq.prompt_token_ids = seq.prompt_token_ids[:prefix_len] + suffix
            req.stolen_tokens = len(suffix)
        else:
            seq.output_token_ids.append(int(meta["first_token"]))
            seq.finish_reason = finish_reason_after(
                seq, seq.output_token_ids[-1], self.engine.eos_token_ids, self.engine.max_model_len
            )
            if seq.finished:
                # P's token (already sent) ends the request (max_tokens 1, EOS, a stop
                # token): only the end goes to the router, right after that token.
                self.streamer.add(
                    req.tokens_subject,
                    TokenItem(
                        request_id=req.request_id,
                        index=len(seq.output_token_ids),
                        finish_reason=seq.finish_reason,
                    ),
                )
                self.table.finish(req)
                self._publish()
                return
        req.timestamps["kv_installed_s"] = time.time()
        self.table.make_runnable(req)

    def admit_migration(self, msg: MigrateRequest) -> AdmitReply:
        """Take over a running request from a peer: reserve, receive its KV, continue.
        Refuses (holding nothing) when not admitting, full, or the id was cancelled here."""
        if not self.admitting:
            return AdmitReply(ok=False, error="worker is not admitting decode work")
        if msg.request_id in self.table.cancelled:
            # Cancelled before this move came (the router's cancel reached us during an
            # earlier move of it, or a cancel overtook this one): taking it would decode
            # for nobody. The source was told as well (it is in custody) and ends it.
            return AdmitReply(ok=False, error=f"request {msg.request_id} was cancelled")
        if msg.request_id in self.table.requests or len(self.table.requests) >= self.max_num_seqs:
            return AdmitReply(ok=False, error="cannot take this request now")
        req, refusal = self._reserve(
            msg.request_id, msg.prompt_len, msg.num_tokens, msg.sampling, msg.tokens_subject
        )
        if req is None:
            return refusal  # type: ignore[return-value]
        req.seq.output_token_ids = list(msg.generated_token_ids)
        req.migrated_from = msg.source_worker_id
        return self._start_receive(req)

    def serve_local(self, msg: PrefillRequest) -> None:
        """Serve a (short) prompt entirely here. Raises NoFreeBlocksError if it cannot fit."""
        if msg.request_id in self.table.requests:
            raise ValueError(f"request {msg.request_id} already here")
        n = len(msg.prompt_token_ids)
        self.engine.check_prompt(n)
        blocks = self._blocks_for_request(n, msg.sampling.max_tokens)
        if not self.bm.can_allocate(blocks):
            raise NoFreeBlocksError(blocks, self.bm.num_free_blocks)
        self.bm.allocate(msg.request_id, blocks * self.bm.block_size)
        seq = self._sequence(msg.request_id, list(msg.prompt_token_ids), msg.sampling)
        req = DecodeRequest(msg.request_id, msg.tokens_subject, seq, time.time(), phase="runnable")
        self.table.requests[msg.request_id] = req
        self.table.make_runnable(req)
