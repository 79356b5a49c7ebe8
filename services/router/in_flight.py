"""One request in flight at the router and its custody: which workers it was given to, and
so which may stream its tokens or hand it on (a queue hand-off at a P→D switch, a
re-pairing with another decode worker, a live migration). Custody follows the request only
through explicit hand-over items, sent before the new worker can stream: a worker the
router was not told of is never trusted, whatever its role or state. The dispatcher
(dispatch.py) owns the table of these; the rules of who may touch an entry live here."""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from services.router.streams import RequestStream
from shared.policy.roles import PREFILL, Role

log = structlog.get_logger("fluidpd.router")


@dataclass
class InFlight:
    """One submitted request: where it runs and its token stream."""

    request_id: str
    prefill_id: str
    decode_id: str
    stream: RequestStream
    arrival_s: float
    prompt_len: int
    max_tokens: int
    cancelled: bool = field(default=False)
    sent_s: float = 0.0  # wall clock when the request was handed to the bus
    # Every worker the request was given to: the pair, then whoever a member handed it to
    # (TokenItem.handed_to). Only members may stream its tokens or hand it on.
    custody: set[str] = field(default_factory=set)
    # A live migration under way: the decode worker that handed the request on still holds
    # it (frozen) and owns the move's outcome until the new decode worker streams (a peer
    # whose receive fails ends it silently). "" when no move is pending.
    moving_from: str = ""

    def __post_init__(self) -> None:
        self.custody.update((self.prefill_id, self.decode_id))

    def may_publish(self, publisher_id: str) -> bool:
        """Whether ``publisher_id`` may stream this request's tokens: only a worker in its
        custody (the pair, or a worker one of them handed it to). The bus has already
        checked that the batch came from ``publisher_id`` (its subject names it, and NATS
        lets a worker publish only under its own id). Pure."""
        return publisher_id in self.custody

    def hand_over(self, publisher_id: str, to_id: str, role: Role) -> None:
        """``publisher_id`` (already checked to be in custody: only a worker the request was
        given to can rebind it) hands the ``role`` part of this request to ``to_id``: a
        queue hand-off at a P->D switch, a re-pairing with another decode worker, a live
        migration (or its hand-back when the request resumes). The notice comes before the
        new worker can stream anything: the old worker waits for the server to process it
        (TokenFlusher.deliver_now) before the new one gets the request, and one server keeps
        the order of what it has processed. Mutates this entry."""
        if role == PREFILL:
            self.prefill_id = to_id
        else:
            if to_id == publisher_id:  # handed back: it resumes there
                self.moving_from = ""
            elif publisher_id in (self.decode_id, self.moving_from):  # a live migration
                self.moving_from = publisher_id
            else:  # a re-pairing by the prefill worker
                self.moving_from = ""
            self.decode_id = to_id
        self.custody.add(to_id)
        log.info(
            "request_handed_over",
            request_id=self.request_id,
            publisher=publisher_id,
            to=to_id,
            role=role,
        )

    def streamed_by(self, publisher_id: str) -> None:
        """An item of this request (not a hand-over) came from ``publisher_id``: once that is
        its decode worker, a pending move has landed there. Mutates this entry."""
        if publisher_id == self.decode_id:
            self.moving_from = ""

    def held_by(self, worker_id: str) -> bool:
        """Whether ``worker_id`` holds this request's fate: its decode worker, the decode
        worker a pending live migration comes from, or its prefill worker before the first
        token (after it the decode side owns the request). Pure."""
        return worker_id in (self.decode_id, self.moving_from) or (
            worker_id == self.prefill_id and self.stream.num_tokens == 0
        )
