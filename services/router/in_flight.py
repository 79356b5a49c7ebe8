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
        migration (or its hand-back when the request resumes). The notice comes before the new worker can stream anything (one publisher's messages
        keep their order through nats-server). Mutates this entry."""
        if role == PREFILL:
            self.prefill_id = to_id
        else:
            self.decode_id = to_id
        self.custody.add(to_id)
        log.info(
            "request_handed_over",
            request_id=self.request_id,
            publisher=publisher_id,
            to=to_id,
            role=role,
        )
