"""Decode admission pressure that a decode worker cannot see in its own tables: requests it
had to refuse for lack of a batch slot or KV, whose prefill workers keep them waiting (their
KV held there) and retry.

Counted so that DPI_adm and telemetry show the demand (the router's pressure pairing and
the controller's FluidRole then see a decode pool that is short of capacity, not an idle
one). A waiting request is forgotten when it is admitted or cancelled here, or when its
prefill worker has not retried for ``ttl_s`` (it was re-paired elsewhere, timed out or
cancelled there): its retries come every ``retry_after_ms`` (tens of ms), so a silent one
is gone. Event loop only; owned by the decode role.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WaitingTotals:
    requests: int
    kv_tokens: int  # what they would reserve at admission


class WaitingAdmissions:
    """request id -> (KV tokens it needs, last refusal time). Mutated by ``note``/``drop``;
    ``totals`` also forgets expired entries."""

    def __init__(self, ttl_s: float = 1.0) -> None:
        if not ttl_s > 0:
            raise ValueError("ttl_s must be > 0")
        self.ttl_s = ttl_s
        self._entries: dict[str, tuple[int, float]] = {}

    def note(self, request_id: str, kv_tokens: int, now_s: float) -> None:
        """A refused admit (it will be retried). Moves the entry to the end (newest)."""
        self._entries.pop(request_id, None)
        self._entries[request_id] = (kv_tokens, now_s)

    def drop(self, request_id: str) -> None:
        """Admitted or cancelled: no longer waiting. Unknown ids are ignored."""
        self._entries.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def totals(self, now_s: float) -> WaitingTotals:
        """Requests waiting and the KV they need, after forgetting the silent ones."""
        limit = now_s - self.ttl_s
        # Insertion order is refusal order (``note`` re-inserts): the stalest come first.
        while self._entries:
            rid, (_, seen) = next(iter(self._entries.items()))
            if seen > limit:
                break
            del self._entries[rid]
        kv = sum(tokens for tokens, _ in self._entries.values())
        return WaitingTotals(len(self._entries), kv)
