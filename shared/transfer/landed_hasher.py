"""One thread that checksums the segments of every receive in progress as they land.

Why a thread that polls: on one host the CMA copy runs inside UCX calls (posting a receive
whose message is already there, or one worker progress that serves several segments back
to back) with the GIL released but the event loop blocked, so hashes dispatched from the
loop would start only after the last segment (measured: +8 ms per 256 MiB). This thread
looks at the receives' ``completed`` flags itself and hashes each landed segment at once.

Why one thread for all receives, round robin: a thread per receive (or a queue of whole
receives) would let one slow or stalled sender hold up the checksums of every receive
queued behind it until its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared.aio import resolve

POLL_S = 0.0001  # how often the thread looks for landed segments while receives are open


def _post(f: _Follow) -> None:
    """Hand ``f``'s checksums to its loop (which may be gone at process exit)."""
    with contextlib.suppress(RuntimeError):  # loop closed: nobody is waiting any more
        f.loop.call_soon_threadsafe(resolve, f.fut, f.sums)


@dataclass(eq=False)
class _Follow:
    reqs: list[Any]  # UCX receive ops, appended by the event loop as it posts them
    runs: list[Any]  # uint8 views the receives land in (a run is appended before its op)
    num_segments: int
    hasher: Callable[[Any], list[int]]
    stop: threading.Event
    loop: asyncio.AbstractEventLoop
    fut: asyncio.Future[list[int]]
    sums: list[int] = field(default_factory=list)
    next_segment: int = 0


class LandedHasher:
    """Checksums per block of the segments of many receives, as each lands.

    ``follow`` is called from an event loop; results come back on that loop. Reads only
    ``completed`` flags and landed bytes; never writes the arena.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._follows: list[_Follow] = []
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def follow(
        self,
        reqs: list[Any],
        runs: list[Any],
        num_segments: int,
        hasher: Callable[[Any], list[int]],
        stop: threading.Event,
    ) -> asyncio.Future[list[int]]:
        """Checksum segment k of a receive once ``reqs[k].completed``, for k in order,
        with ``hasher`` (a checksum.BlockHasher: run -> per-block sums, on the run's device).

        The returned future gets every block's checksum in logical order, or a partial
        list once ``stop`` is set (the caller has given up and discards it).
        Raises RuntimeError after ``close``.
        """
        loop = asyncio.get_running_loop()
        f = _Follow(reqs, runs, num_segments, hasher, stop, loop, loop.create_future())
        with self._lock:
            if self._closed:
                raise RuntimeError("LandedHasher is closed")
            self._follows.append(f)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kv-landed-hash", daemon=True
                )
                self._thread.start()
        self._wake.set()
        return f.fut

    def close(self) -> None:
        """Stop the thread (idempotent); receives still followed get partial results."""
        with self._lock:
            self._closed = True
        self._wake.set()

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    follows, self._follows = self._follows, []
                    for f in follows:
                        _post(f)
                    return
                follows = list(self._follows)
                if not follows:
                    self._wake.clear()
            if not follows:
                self._wake.wait()
                continue
            hashed = False
            for f in follows:  # one segment per receive per round: a stalled one waits alone
                k = f.next_segment
                if not f.stop.is_set() and len(f.reqs) > k and f.reqs[k].completed:
                    f.sums.extend(f.hasher(f.runs[k]))
                    f.next_segment = k + 1
                    hashed = True
                if f.stop.is_set() or f.next_segment == f.num_segments:
                    with self._lock:
                        self._follows.remove(f)
                    _post(f)
            if not hashed:
                time.sleep(POLL_S)
