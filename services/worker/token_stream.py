"""Per-iteration token batching: one TokenBatch message per router per worker iteration.

The scheduler ``add``s items while it commits an iteration, then ``flush``es once; the bus
message rate is then (iterations × routers), independent of the number of streams.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from shared.engine.logprobs import Logprob
from shared.messages import StreamSequencer, TokenItem, TokenLogprob, pack_token_batches


def wire_logprobs(lps: Iterable[Logprob | None]) -> tuple[TokenLogprob, ...]:
    """Engine logprobs -> their wire form (None entries are dropped: not asked)."""
    return tuple(
        TokenLogprob(logprob=lp.logprob, top_ids=lp.top_ids, top_logprobs=lp.top_logprobs)
        for lp in lps
        if lp is not None
    )


class TokenStreamer:
    """Collects TokenItems by destination subject. Not thread-safe (event loop only)."""

    def __init__(self, sequencer: StreamSequencer) -> None:
        self._sequencer = sequencer
        self._pending: dict[str, list[TokenItem]] = defaultdict(list)

    def add(self, subject: str, item: TokenItem) -> None:
        self._pending[subject].append(item)

    def take(self) -> list[tuple[str, object]]:
        """Pack everything pending into (subject, TokenBatch) pairs and clear the buffer."""
        out: list[tuple[str, object]] = []
        for subject, items in self._pending.items():
            for batch in pack_token_batches(self._sequencer, subject, items):
                out.append((subject, batch))
        self._pending.clear()
        return out

    def __len__(self) -> int:
        return sum(len(v) for v in self._pending.values())
