"""Per-request token assembly: items from two publishers → one ordered token stream.

The prefill worker sends the token at index 0 and the decode worker 1..N; their messages
may arrive in either order and (after a reconnect) twice. ``RequestStream`` keeps tokens
by output position, releases them only in order, drops duplicates, and ends the stream at
the first finish it can honour: an ``error``/``cancelled`` item ends it at once, a ``stop``
/``length`` item once every token before its end has arrived. Later items are ignored.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from shared.messages import ABORT_REASONS, TokenItem, TokenLogprob


@dataclass(frozen=True)
class StreamEnd:
    """How a request ended: ``finish_reason`` stop/length/error/cancelled (+ error info)."""

    finish_reason: str
    error: str | None = None
    error_code: str | None = None

    @property
    def failed(self) -> bool:
        return self.finish_reason in ABORT_REASONS


@dataclass
class StreamChunk:
    """What ``RequestStream.next`` returns: new in-order tokens, their receive times, and
    the end (set on the last chunk only)."""

    token_ids: list[int] = field(default_factory=list)
    receive_times_s: list[float] = field(default_factory=list)
    end: StreamEnd | None = None
    logprobs: list[TokenLogprob | None] = field(default_factory=list)  # one per token


class RequestStream:
    """Reassembles one request's output. Event loop only; not thread-safe.

    ``offer``/``fail`` are called from bus callbacks; one consumer awaits ``next``.
    With ``prompt_len`` > 0 (echo with logprobs) nothing is released until the logprobs
    of prompt tokens 1..prompt_len-1 are all in (``prompt_logprobs``); they come from P
    and, on a split, D, in any order.
    """

    def __init__(self, request_id: str, prompt_len: int = 0) -> None:
        self.request_id = request_id
        self.prompt_logprobs: dict[int, TokenLogprob] = {}  # prompt position -> logprob
        self._prompt_len = prompt_len
        self._missing_prompt = max(0, prompt_len - 1)
        self._lp_by_pos: dict[int, TokenLogprob] = {}
        self.timestamps: dict[str, float] = {}  # named instants reported by workers
        self._by_pos: dict[int, tuple[int, float]] = {}  # position -> (token, receive time)
        self._next_pos = 0  # first position not yet released to the consumer
        self._released = 0  # tokens handed out by next()
        self._end_pos: int | None = None  # a stop/length item's end position
        self._end: StreamEnd | None = None  # decided end (abort, or stop/length reached)
        self._pending_end: StreamEnd | None = None
        self._delivered_end = False
        self._wakeup = asyncio.Event()

    @property
    def finished(self) -> bool:
        """True once the end is decided (the consumer may not have seen it yet)."""
        return self._end is not None

    @property
    def num_tokens(self) -> int:
        """Tokens released in order so far."""
        return self._next_pos

    def offer(self, item: TokenItem, now_s: float | None = None) -> None:
        """Take one item (any order, maybe a duplicate). Mutates the stream."""
        if self._end is not None:
            return
        now = time.time() if now_s is None else now_s
        for name, value in item.timestamps.items():
            self.timestamps.setdefault(name, value)
        for offset, plp in enumerate(item.prompt_logprobs):
            ppos = item.prompt_logprobs_start + offset
            fresh = 0 < ppos < self._prompt_len and ppos not in self.prompt_logprobs
            if fresh and self._missing_prompt:
                self.prompt_logprobs[ppos] = plp
                self._missing_prompt -= 1
        for offset, token in enumerate(item.token_ids):
            pos = item.index + offset
            fresh = pos >= self._next_pos and pos not in self._by_pos
            if fresh and (self._end_pos is None or pos < self._end_pos):
                self._by_pos[pos] = (token, now)
                if item.logprobs:
                    self._lp_by_pos[pos] = item.logprobs[offset]
        if item.finish_reason is not None:
            end = StreamEnd(item.finish_reason, item.error, item.error_code)
            if end.failed:
                self._end = end
            elif self._end_pos is None:
                self._end_pos = item.index + len(item.token_ids)
                self._pending_end = end
                for pos in [p for p in self._by_pos if p >= self._end_pos]:
                    del self._by_pos[pos]
        self._advance()
        self._wakeup.set()

    def fail(self, error: str, error_code: str, reason: str = "error") -> None:
        """End the stream from the router's side (worker gone, timeout). No-op when ended."""
        if self._end is None:
            self._end = StreamEnd(reason, error, error_code)
            self._wakeup.set()

    def _advance(self) -> None:
        if self._missing_prompt:
            return  # echo: the prompt's logprobs go out first, whole
        while self._next_pos in self._by_pos:
            self._next_pos += 1
        if self._end is None and self._end_pos is not None and self._next_pos >= self._end_pos:
            self._end = self._pending_end

    def _take(self) -> StreamChunk:
        chunk = StreamChunk()
        for pos in range(self._released, self._next_pos):
            token, recv = self._by_pos.pop(pos)
            chunk.token_ids.append(token)
            chunk.receive_times_s.append(recv)
            chunk.logprobs.append(self._lp_by_pos.pop(pos, None))
        self._released = self._next_pos
        if self._end is not None:
            chunk.end = self._end
            self._delivered_end = True
        return chunk

    async def next(self) -> StreamChunk:
        """Wait for new tokens or the end. Raises RuntimeError if called after the end."""
        if self._delivered_end:
            raise RuntimeError(f"stream {self.request_id} already ended")
        while self._released == self._next_pos and self._end is None:
            self._wakeup.clear()
            await self._wakeup.wait()
        return self._take()
