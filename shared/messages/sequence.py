"""Sequence numbers for stream messages: assign on the publisher, check on the receiver.

A publisher numbers the messages of each stream (one subject) 0, 1, 2, ... within one
``epoch`` (its incarnation: start time in ns). A receiver keeps, per publisher, the
highest (epoch, seq) seen and classifies each new message:

* next in line → accepted;
* ahead by k > 1 → accepted, ``gap = k - 1`` messages were lost;
* at or behind the last seen (duplicate, or a reordered old one) → dropped;
* a newer epoch → the publisher restarted: accepted, the stream starts over (no gap);
* an older epoch → a late message from a dead incarnation: dropped;
* an epoch in the future (beyond ``MAX_EPOCH_AHEAD_NS`` of the receiver's wall clock) →
  dropped: an epoch is a start time, and accepting one from the future would let a single
  forged message silence the real publisher until its clock catches up.

The first message seen from a publisher is accepted whatever its seq (we may have
subscribed mid-stream).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

# Clock skew tolerated between a publisher and a receiver on other hosts.
MAX_EPOCH_AHEAD_NS = 60 * 10**9


@dataclass(frozen=True)
class Observation:
    """What the tracker made of one message."""

    accepted: bool
    gap: int = 0  # messages missing right before this one (0 when none or dropped)
    restarted: bool = False  # first message of a new epoch of a known publisher


class SequenceTracker:
    """Per-publisher gap/duplicate detection. Not thread-safe (one event loop).

    Memory: one entry per publisher seen; call :meth:`forget` when one leaves.
    """

    def __init__(
        self,
        max_epoch_ahead_ns: int = MAX_EPOCH_AHEAD_NS,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self._last: dict[str, tuple[int, int]] = {}
        self._max_epoch_ahead_ns = max_epoch_ahead_ns
        self._clock_ns = clock_ns
        self.gaps_total = 0
        self.dropped_total = 0
        self.future_epochs_total = 0

    def observe(self, publisher_id: str, epoch: int, seq: int) -> Observation:
        """Classify a message and, if accepted, advance the publisher's position.

        Mutates the tracker. Never raises.
        """
        if epoch > self._clock_ns() + self._max_epoch_ahead_ns:
            self.future_epochs_total += 1
            self.dropped_total += 1
            return Observation(accepted=False)
        last = self._last.get(publisher_id)
        if last is None:
            self._last[publisher_id] = (epoch, seq)
            return Observation(accepted=True)
        last_epoch, last_seq = last
        if epoch > last_epoch:
            self._last[publisher_id] = (epoch, seq)
            return Observation(accepted=True, restarted=True)
        if epoch < last_epoch or seq <= last_seq:
            self.dropped_total += 1
            return Observation(accepted=False)
        gap = seq - last_seq - 1
        self.gaps_total += gap
        self._last[publisher_id] = (epoch, seq)
        return Observation(accepted=True, gap=gap)

    def forget(self, publisher_id: str) -> None:
        """Drop the state kept for ``publisher_id`` (it left the cluster)."""
        self._last.pop(publisher_id, None)

    def publishers(self) -> tuple[str, ...]:
        """Ids of the publishers currently tracked."""
        return tuple(self._last)


class StreamSequencer:
    """Publisher side: one epoch for this process, a seq counter per stream key (subject).

    ``epoch`` defaults to the wall clock in ns at construction, so a restarted publisher
    has a larger epoch than its previous incarnation.
    """

    def __init__(self, publisher_id: str, epoch: int | None = None) -> None:
        self.publisher_id = publisher_id
        self.epoch = time.time_ns() if epoch is None else epoch
        self._next: dict[str, int] = {}

    def next_seq(self, stream: str) -> int:
        """Return the seq for the next message on ``stream`` and advance. Mutates."""
        seq = self._next.get(stream, 0)
        self._next[stream] = seq + 1
        return seq
