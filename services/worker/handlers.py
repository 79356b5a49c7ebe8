"""The worker's request handlers: prefill, admit, migrate, cancel (the runtime serves them
on this worker's subjects, each through the bus's one handler wrapper).

Each checks what the message cannot check itself (token ids inside the vocabulary) and
that this worker is Active in the role the message needs, then hands the message to that
role. Bad input raises a typed error (the wrapper replies with it); a worker in the wrong
role or state answers a refusal the sender re-pairs on.
"""

from __future__ import annotations

import structlog

from services.worker.decode.decode_role import DecodeRole
from services.worker.prefill.prefill_role import PrefillRole
from services.worker.status import WorkerStatus
from shared.bus import Bus
from shared.errors import InvalidRequestError, WorkerNotActiveError
from shared.messages import (
    Ack,
    AdmitReply,
    AdmitRequest,
    CancelRequest,
    MigrateRequest,
    PrefillRequest,
    Subjects,
)
from shared.policy.roles import ACTIVE, DECODE, PREFILL

log = structlog.get_logger(__name__)


class WorkerHandlers:
    """Stateless: routes each message to a role."""

    def __init__(
        self,
        worker_id: str,
        status: WorkerStatus,
        prefill: PrefillRole,
        decode: DecodeRole,
        bus: Bus,
        subjects: Subjects,
        *,
        vocab_size: int,
    ) -> None:
        self.worker_id = worker_id
        self._status = status
        self._prefill = prefill
        self._decode = decode
        self._bus = bus
        self._subjects = subjects
        self.vocab_size = vocab_size

    def _check_vocab(self, token_ids: tuple[int, ...], field: str) -> None:
        """Refuse ids outside the model's vocabulary (the router checks; a client talking
        NATS directly may not). Raises InvalidRequestError: an id the embedding cannot look
        up would make the engine step raise and take the whole worker out (failure.py)."""
        if token_ids and max(token_ids) >= self.vocab_size:  # >= 0: the message checks it
            raise InvalidRequestError(
                f"{field}: token id {max(token_ids)} is out of the vocabulary "
                f"[0, {self.vocab_size})"
            )

    async def on_prefill(self, msg: PrefillRequest) -> Ack:
        self._check_vocab(msg.prompt_token_ids, "prompt_token_ids")
        status = self._status
        if status.state != ACTIVE:
            # Routers only pick Active workers; this is the race with a state change.
            raise WorkerNotActiveError(f"worker {self.worker_id} is {status.state}")
        seed = msg.sampling.seed if msg.sampling.seed is not None else 0
        if status.role == PREFILL and msg.decode_worker_id != self.worker_id:
            self._prefill.enqueue(msg, seed)
        else:
            # Routed here whole (short prompt, or this worker is the pair's decode side).
            self._decode.serve_local(msg)
        return Ack()

    async def on_admit(self, msg: AdmitRequest) -> AdmitReply:
        self._check_vocab(msg.suffix_token_ids, "suffix_token_ids")
        status = self._status
        if not status.serves(DECODE):
            # Not (or no longer) a decode worker: the prefill side re-pairs the request.
            return AdmitReply(
                ok=False, error=f"worker is {status.role}/{status.state}", retry_after_ms=0
            )
        return self._decode.admit(msg)

    async def on_migrate(self, msg: MigrateRequest) -> AdmitReply:
        self._check_vocab(msg.generated_token_ids, "generated_token_ids")
        status = self._status
        if not status.serves(DECODE):
            return AdmitReply(ok=False, error=f"worker is {status.role}/{status.state}")
        return self._decode.admit_migration(msg)

    async def on_cancel(self, msg: CancelRequest) -> None:
        found = self._prefill.cancel(msg.request_id) | self._decode.cancel(msg.request_id)
        peer = self._decode.take_migrated_peer(msg.request_id)
        if peer is not None:  # it lives on a peer now: pass the cancel on
            await self._bus.publish(self._subjects.worker_cancel(peer), msg)
        if found:
            log.info("request_cancelled", request_id=msg.request_id, reason=msg.reason)
        return None
