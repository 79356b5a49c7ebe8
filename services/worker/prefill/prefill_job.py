"""One queued prompt on a prefill worker, with the clocks its deadlines and stages use."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.messages import PrefillRequest, TokenLogprob
from shared.policy.prefill_pressure import QueuedRequest


@dataclass(eq=False)
class PrefillJob:
    msg: PrefillRequest
    received_s: float  # our monotonic clock
    deadline_s: float  # our monotonic clock
    seed: int
    arrival_s: float = 0.0  # our monotonic clock: when the router received the request
    cancelled: bool = False
    timestamps: dict[str, float] = field(default_factory=dict)
    # Set by the prefill step when the request asks for logprobs (sent with the first token).
    first_logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def request_id(self) -> str:
        return self.msg.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.msg.prompt_token_ids)

    def queued_request(self) -> QueuedRequest:
        """This job as the pressure policy sees it (PPI, Algorithm 1). Pure."""
        return QueuedRequest(
            self.request_id, self.arrival_s, self.prompt_len, self.msg.decode_worker_id
        )
