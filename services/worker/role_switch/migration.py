"""Live migration of one running decode request to a peer decode worker (D->P switch).

The request leaves the batch at a step boundary, its KV moves through the same transfer
layer as a prefill handoff, and the peer continues from the same token index with the same
seed, so the client's stream has no gap and no repeat.

Outcomes, and what becomes of the request here:

* moved: the peer verified and installed the KV -> dropped here (``DecodeRole.migrated``).
  Before the KV leaves, the router is told that the peer now decodes the request (a
  hand-over item on the request's token stream, processed by the server first: the peer
  streams over its own connection): the router takes a
  request's tokens only from workers it was told of (the peer may itself be leaving
  decode, a D->P move of several workers at once, so its role or state says nothing). A
  request that resumes here is handed back the same way;
* refused or rejected before anything could be installed (the peer's admit said no, its
  ticket does not verify, the sender's error is retryable) -> the next peer is tried, and
  if none takes it the request resumes here (``unfreeze``); a peer that reserved blocks for
  a ticket we never used is told to cancel, so its reservation is freed at once;
* cancelled while it moves (the router's cancel reaches only us until the peer streams):
  not moved if the peer has not received it yet (a peer that reserved for it is told to
  cancel), else passed on to the peer once installed there, so nothing decodes for nobody;
* outcome unknown (our last message went out but no verdict came back: the peer may have
  installed the blocks and be decoding it) -> the request is **never** resumed here (one
  request must not run on two workers): its stream ends with ``migration_failed``, its
  blocks are freed, and the peer is told to cancel its copy.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog

from services.worker.decode.decode_request import DecodeRequest
from services.worker.decode.decode_table import DecodeTable
from shared.bus import Bus
from shared.engine.interface import StepEngine
from shared.messages import AdmitReply, CancelRequest, MigrateRequest, Subjects
from shared.messages import SamplingParams as WireParams
from shared.transfer.envelope import TransferTicket
from shared.transfer.errors import TransferError
from shared.transfer.sender import KVSender

log = structlog.get_logger(__name__)

_MIGRATE_ADMIT_TIMEOUT_S = 2.0


class Migrator:
    """Moves running requests out of the decode table ``decode`` to peers. Holds no
    state of its own."""

    def __init__(
        self,
        worker_id: str,
        bus: Bus,
        subjects: Subjects,
        engine: StepEngine,
        sender: KVSender,
        decode: DecodeTable,
        *,
        secret: bytes,
        transfer_timeout_s: float,
        deliver_now: Callable[[], Awaitable[None]],
    ) -> None:
        """``deliver_now`` (TokenFlusher.deliver_now) returns once a hand-over notice is
        processed by the server: only then may the peer stream (module doc)."""
        self.worker_id = worker_id
        self._deliver_now = deliver_now
        self._bus = bus
        self._subjects = subjects
        self._engine = engine
        self._sender = sender
        self._decode = decode
        self._secret = secret
        self.transfer_timeout_s = transfer_timeout_s

    def _message(self, req: DecodeRequest) -> MigrateRequest:
        seq = req.seq
        p = seq.params
        return MigrateRequest(
            request_id=req.request_id,
            router_id="migrated",
            tokens_subject=req.tokens_subject,
            source_worker_id=self.worker_id,
            prompt_len=len(seq.prompt_token_ids),
            num_tokens=seq.num_cached_tokens,
            generated_token_ids=tuple(seq.output_token_ids),
            sampling=WireParams(
                max_tokens=p.max_tokens,
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=max(0, p.top_k),
                seed=seq.seed,
                stop_token_ids=tuple(p.stop_token_ids),
                ignore_eos=p.ignore_eos,
                # The peer scores only the prompt rows it still computes; sent ones stay sent.
                logprobs=p.logprobs,
                prompt_logprobs=p.prompt_logprobs,
            ),
            rng_offset=len(seq.output_token_ids),
        )

    async def _cancel_on(self, peer: str, request_id: str, reason: str) -> None:
        """Ask ``peer`` to drop what it holds of ``request_id`` (a reservation or a copy)."""
        try:
            await self._bus.publish(
                self._subjects.worker_cancel(peer),
                CancelRequest(request_id=request_id, reason=reason),
            )
        except Exception as exc:  # the peer's receive deadline frees it anyway
            log.warning("migration_cancel_failed", request_id=request_id, peer=peer, error=str(exc))

    @staticmethod
    def _nothing_installed(exc: BaseException) -> bool:
        """True when ``exc`` from ``KVSender.send`` proves the peer installed nothing."""
        return isinstance(exc, ValueError) or (isinstance(exc, TransferError) and exc.retryable)

    async def migrate_out(self, request_id: str, peers: list[str]) -> bool:
        """Live-migrate a running decode request to the first of ``peers`` that takes it.

        Returns True when the request no longer runs here (moved, or it finished or was
        cancelled meanwhile, or it was failed because the outcome is unknown), False when it
        resumed here (no peer took it). Never leaves it frozen; never raises but for
        cancellation (which resumes it)."""
        dec = self._decode
        req = await dec.freeze(request_id)
        if req is None:
            return True  # finished or cancelled meanwhile: nothing left to move
        settled = announced = False
        try:
            msg = self._message(req)
            num_tokens = req.seq.num_cached_tokens
            for peer in peers:
                if request_id in dec.doomed:
                    return True  # cancelled meanwhile: nothing to move (unfreeze ends it)
                try:
                    reply = await self._bus.request(
                        self._subjects.worker_migrate(peer),
                        msg,
                        AdmitReply,
                        _MIGRATE_ADMIT_TIMEOUT_S,
                    )
                except Exception:
                    continue
                if not reply.ok:
                    continue
                if request_id in dec.doomed:
                    # Cancelled while the peer reserved for it; the router's cancel went
                    # only to us (it does not know the peer yet): free the peer's blocks.
                    await self._cancel_on(peer, request_id, "cancelled while migrating")
                    return True
                try:  # e.g. the peer seals with another cluster secret (rotation)
                    ticket = TransferTicket.decode(reply.ticket, self._secret)
                except Exception as exc:
                    log.warning(
                        "migration_ticket_rejected",
                        request_id=request_id,
                        peer=peer,
                        error=str(exc)[:200],
                    )
                    await self._cancel_on(peer, request_id, "migration ticket rejected")
                    continue
                table = self._engine.block_manager.block_table(request_id)[: ticket.num_blocks]
                dec.hand_over(req, peer)  # before the peer can stream anything (module doc)
                await self._deliver_now()
                announced = True
                try:
                    await self._sender.send(
                        ticket,
                        self._engine.arena,
                        table,
                        timeout_s=self.transfer_timeout_s,
                        meta={"migrated_cached_tokens": num_tokens},
                    )
                except Exception as exc:
                    if self._nothing_installed(exc):
                        log.warning(
                            "migration_failed",
                            request_id=request_id,
                            peer=peer,
                            error=str(exc)[:200],
                        )
                        continue
                    log.error(
                        "migration_outcome_unknown",
                        request_id=request_id,
                        peer=peer,
                        error=str(exc)[:200],
                    )
                    settled = True
                    dec.fail_frozen(
                        req,
                        f"moving this request to worker {peer} failed with an unknown outcome "
                        "(it is not resumed, so that it never runs twice); retry",
                        "migration_failed",
                    )
                    await self._cancel_on(peer, request_id, "migration outcome unknown")
                    return True
                settled = True
                cancelled = request_id in dec.doomed  # during the send: the peer runs it now
                dec.migrated(req, peer)
                log.info("request_migrated", request_id=request_id, peer=peer, kv_tokens=num_tokens)
                if cancelled:  # our cancel handler found no peer to pass it on to: pass it now
                    await self._cancel_on(peer, request_id, "cancelled while migrating")
                return True
            if announced:  # it resumes here: take it back before the next token
                dec.hand_over(req, self.worker_id)
                await self._deliver_now()
            return False
        finally:
            if not settled:
                dec.unfreeze(req)
