"""Decode admission pressure that a decode worker cannot see in its own tables: requests it
had to refuse for lack of a batch slot or KV, whose prefill workers keep them waiting (their
KV held there) and retry.

Counted so that DPI_adm and telemetry show the demand (the router's pressure pairing and
the controller's FluidRole then see a decode pool that is short of capacity, not an idle
one), and served in the order they first asked: capacity that frees goes to the oldest
waiting request, not to whichever retry happens to arrive first (``ahead``), so no request
starves behind luckier retries. A waiting request is forgotten when it is admitted or
cancelled here, or when its prefill worker has not retried for ``ttl_s`` (it was re-paired
elsewhere, timed out or cancelled there): its retries come every ``retry_after_ms`` (tens of
ms), so a silent one is gone. Event loop only; owned by the decode role.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WaitingTotals:
    requests: int
    kv_tokens: int  # what they would reserve at admission


class WaitingAdmissions:
    """request id -> (KV tokens it needs, first refusal time, last refusal time), in the
    order of first refusal. Mutated by ``note``/``drop``; the queries forget expired
    entries."""

    def __init__(self, ttl_s: float = 1.0) -> None:
        if not ttl_s > 0:
            raise ValueError("ttl_s must be > 0")
        self.ttl_s = ttl_s
        self._entries: dict[str, tuple[int, float, float]] = {}

    def note(self, request_id: str, kv_tokens: int, now_s: float) -> None:
        """A refused admit (it will be retried). Keeps its place in the order."""
        first = self._entries.get(request_id, (0, now_s, now_s))[1]
        self._entries[request_id] = (kv_tokens, first, now_s)

    def drop(self, request_id: str) -> None:
        """Admitted or cancelled: no longer waiting. Unknown ids are ignored."""
        self._entries.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def _expire(self, now_s: float) -> None:
        limit = now_s - self.ttl_s
        for rid in [r for r, (_, _, last) in self._entries.items() if last <= limit]:
            del self._entries[rid]

    def totals(self, now_s: float) -> WaitingTotals:
        """Requests waiting and the KV they need, after forgetting the silent ones."""
        self._expire(now_s)
        kv = sum(tokens for tokens, _, _ in self._entries.values())
        return WaitingTotals(len(self._entries), kv)

    def ahead(self, request_id: str, now_s: float) -> WaitingTotals:
        """The waiting requests first refused before ``request_id`` (all of them when it
        is not waiting yet): what capacity must serve first."""
        self._expire(now_s)
        n = kv = 0
        for rid, (tokens, _, _) in self._entries.items():
            if rid == request_id:
                break
            n += 1
            kv += tokens
        return WaitingTotals(n, kv)
