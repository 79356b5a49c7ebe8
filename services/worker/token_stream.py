"""Per-iteration token batching: one TokenBatch message per router per worker iteration.

The scheduler ``add``s items while it commits an iteration, then ``flush``es once; the bus
message rate is then (iterations × routers), independent of the number of streams.
``TokenFlusher`` publishes them (``deliver_now`` when order against another worker's
items matters: a custody hand-over).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterable

import structlog

from shared.aio import resolve
from shared.bus import Bus
from shared.engine.logprobs import Logprob
from shared.messages import (
    StreamSequencer,
    Subjects,
    TokenItem,
    TokenLogprob,
    pack_token_batches,
)

log = structlog.get_logger(__name__)


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


class TokenFlusher:
    """Publishes what the streamer collected, from one task (``run``) so batches leave in
    order. ``request_flush`` asks for a flush; ``flush_now`` also waits for it."""

    def __init__(self, streamer: TokenStreamer, bus: Bus, subjects: Subjects, worker_id: str):
        self._streamer = streamer
        self._bus = bus
        self._subjects = subjects
        self.worker_id = worker_id
        self._event = asyncio.Event()
        self._waiters: list[asyncio.Future[None]] = []

    def request_flush(self) -> None:
        self._event.set()

    async def flush_now(self) -> None:
        """Return once everything pending has been handed to the bus client (whose own
        flusher, woken first, writes it before the caller runs again). A first token
        waits for this before the KV export's CPU work starts on this loop."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._event.set()
        await fut

    async def deliver_now(self) -> None:
        """``flush_now``, then a round trip to the server: returns once nats-server has
        processed everything published so far, so a message another worker publishes
        after this returns reaches the router after ours (one server orders what it has
        processed; it owes no order across connections for what is still in flight; with
        one server, as deploy/ runs it: a NATS cluster's routes would void this). A
        custody hand-over needs that: the router drops items from a worker it was not told
        of, and the new worker streams over its own connection. If the round trip fails
        (bus down, reconnecting) this logs and returns: the notice is still queued in the
        client, as with ``flush_now``."""
        await self.flush_now()
        try:
            await self._bus.flush()
        except Exception as exc:
            log.warning("token_deliver_unconfirmed", error=f"{type(exc).__name__}: {exc}"[:200])

    async def run(self) -> None:
        """The flush loop. Runs until cancelled."""
        while True:
            await self._event.wait()
            self._event.clear()
            waiters, self._waiters = self._waiters, []
            for subject, batch in self._streamer.take():
                try:
                    # Under our own id: NATS lets this worker publish nowhere else.
                    own = self._subjects.tokens_from(subject, self.worker_id)
                    await self._bus.publish(own, batch)  # type: ignore[arg-type]
                except Exception:
                    log.exception("token_publish_failed", subject=subject)
            for fut in waiters:
                resolve(fut, None)
