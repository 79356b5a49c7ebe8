"""Pressure-aware pairing: ``PressurePolicy``, its ``PressureConfig``, and ``make_policy``,
which builds a pairing policy by name (the contract and the round-robin baseline it falls
back to are pairing.py).

``pressure`` (the default; our extension, the paper only says the router "assigns each
request to a prefill/decode worker pair") ranks Active workers by their telemetry, **plus
the work this router has sent them since that telemetry**:

- prefill: first the wait a newcomer would see (``prefill_wait_s``): the work queued there
  (telemetry ``queue_work_s``, Σ T_pre + the running prefill's remainder) plus the
  predicted prefill time T_pre(L) (eq. 2) of every request sent since the telemetry — the
  quantity the router's door sheds on, so a request goes where the door admits it if
  anywhere. Ties: the estimated PPI (eq. 3–5), which rises by T_pre(L) / S_TTFT per
  assignment (its deadline is ~S_TTFT away; ``prefill_score``); then telemetry queue
  length + requests sent since. (Ranking on the PPI first shed more than round robin at
  saturation: docs/results.md, Session 11.)
- decode: the estimated DPI_adm (eq. 8). The KV each request sent since will reserve at
  admission (prompt + decode horizon) counts against the worker's free capacity, and
  each takes one admission slot (``max_num_seqs``): the larger fraction ranks
  (``decode_score``). Ties: requests sent since, then most free KV. A decode worker
  reserves only at admission, after the request's prefill-queue wait, so a pairing counts
  until the router settles it (first token or end, ``settle``) when the caller passes
  request ids; otherwise until the worker's next telemetry, like prefill.

So a burst between two telemetry messages is water-filled over the workers in order of
their headroom instead of landing on the one that looked emptiest. Workers without fresh
telemetry rank last; with no fresh telemetry at all it falls back to round robin.

Telemetry supersedes the local estimate: an arriving message drops the sends it already
reflects. The worker stamps telemetry with its own wall clock, which need not agree with
ours, so a message received at ``t`` is taken to reflect the sends made up to
``t − telemetry_lag_s`` (NATS transit both ways plus the snapshot); later sends stay counted
until the next message. The approximation errs toward over-counting for one period.

``prefill_wait_s`` / ``prefill_score`` / ``decode_score`` (shared/policy/pairing.py) are pure
and shared with the simulator (services/sim/router.py), so both rank workers the same way. Deterministic:
ids break every remaining tie. Only records in state ``active`` are candidates (callers
pass them).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.router.pairing import RoundRobinPolicy, candidate_ids
from shared.engine.profiles import load_profile
from shared.messages import WorkerRecord, WorkerTelemetry
from shared.policy.pairing import decode_score, prefill_score, prefill_wait_s
from shared.policy.predictors import LatencyProfile
from shared.policy.pressure import admission_kv_tokens
from shared.policy.roles import DECODE, PREFILL, Role


@dataclass(frozen=True)
class PressureConfig:
    """Knobs of PressurePolicy. Validated on construction (raises ValueError).

    ``profile`` predicts T_pre (the workers' profile; None = the shipped default).
    ``ttft_s`` is the TTFT SLO requests are sent with. ``default_prompt_tokens`` and
    ``default_max_tokens`` stand in when ``choose`` is not told the request's sizes.
    A decode worker's reservation horizon and admission slots come from its registry
    record (``decode_reserve_tokens``, ``max_num_seqs``). ``pending_expiry_s`` bounds how
    long an unsettled decode pairing counts (see ``choose``). ``telemetry_lag_s``: module
    doc.
    """

    stale_after_s: float = 1.0
    ttft_s: float = 2.0
    profile: LatencyProfile | None = None
    default_prompt_tokens: int = 1024
    default_max_tokens: int = 256
    pending_expiry_s: float = 60.0
    telemetry_lag_s: float = 0.005
    _t_pre: LatencyProfile = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("stale_after_s", "ttft_s", "pending_expiry_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be > 0")
        if not 0 <= self.telemetry_lag_s < self.stale_after_s:
            raise ValueError("telemetry_lag_s must be in [0, stale_after_s)")
        for name in ("default_prompt_tokens", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        object.__setattr__(self, "_t_pre", self.profile or load_profile(""))

    def prefill_work_s(self, prompt_tokens: int) -> float:
        """T_pre(L) (eq. 2), never negative."""
        return max(0.0, self._t_pre.prefill_time_s(prompt_tokens))


class _SentLedger:
    """What one router sent to one worker that its last telemetry may not show yet:
    (send time, T_pre seconds, KV tokens) in send order, and their sums."""

    __slots__ = ("entries", "kv_tokens", "work_s")

    def __init__(self) -> None:
        self.entries: deque[tuple[float, float, int]] = deque()
        self.work_s = 0.0
        self.kv_tokens = 0

    def add(self, now: float, work_s: float, kv_tokens: int) -> None:
        self.entries.append((now, work_s, kv_tokens))
        self.work_s += work_s
        self.kv_tokens += kv_tokens

    def drop_last(self, entry: tuple[float, float, int]) -> None:
        """Forget ``entry`` if it is the latest send (a withdrawn choice); else nothing."""
        if self.entries and self.entries[-1] == entry:
            self.entries.pop()
            self.work_s -= entry[1]
            self.kv_tokens -= entry[2]
            if not self.entries:
                self.work_s, self.kv_tokens = 0.0, 0

    def drop_until(self, t: float) -> None:
        """Forget the sends made at or before ``t`` (telemetry now reflects them)."""
        entries = self.entries
        while entries and entries[0][0] <= t:
            _, work_s, kv = entries.popleft()
            self.work_s -= work_s
            self.kv_tokens -= kv
        if not entries:  # no float residue once empty
            self.work_s, self.kv_tokens = 0.0, 0


class PressurePolicy:
    """Pressure-aware pairing (module doc). Mutates its telemetry view and send ledgers."""

    name = "pressure"

    def __init__(self, stale_after_s: float = 1.0, cfg: PressureConfig | None = None) -> None:
        self.cfg = cfg or PressureConfig(stale_after_s=stale_after_s)
        self.stale_after_s = self.cfg.stale_after_s
        self._latest: dict[str, tuple[WorkerTelemetry, float]] = {}  # id -> (msg, mono time)
        self._sent: dict[str, _SentLedger] = {}
        # Decode pairings not yet admitted (see ``settle``): request id -> (decode id, send
        # time, KV tokens), in send order; and their sums per decode worker.
        self._pending: dict[str, tuple[str, float, int]] = {}
        self._pending_kv: dict[str, int] = {}
        self._pending_n: dict[str, int] = {}
        self._fallback = RoundRobinPolicy()
        # The latest choice made with a request id, (id, prefill id, its ledger entry): the
        # one ``withdraw`` can undo.
        self._last: tuple[str, str, tuple[float, float, int]] | None = None

    def observe(self, msg: WorkerTelemetry, now_mono_s: float | None = None) -> None:
        """Record a telemetry message (bus callback). An older message of the same worker
        incarnation (lower ``seq``) is ignored."""
        now = time.monotonic() if now_mono_s is None else now_mono_s
        wid = msg.publisher_id
        prev = self._latest.get(wid)
        if prev is not None and prev[0].epoch == msg.epoch and msg.seq < prev[0].seq:
            return
        self._latest[wid] = (msg, now)
        ledger = self._sent.get(wid)
        if ledger is not None:
            ledger.drop_until(now - self.cfg.telemetry_lag_s)

    def forget(self, worker_id: str) -> None:
        self._latest.pop(worker_id, None)
        self._sent.pop(worker_id, None)
        for rid in [r for r, (d, _, _) in self._pending.items() if d == worker_id]:
            self.settle(rid)

    def settle(self, request_id: str) -> None:
        """The request no longer waits for decode admission (its first token came back, or it
        ended): stop counting it against its decode worker. Unknown ids are ignored."""
        entry = self._pending.pop(request_id, None)
        if entry is not None:
            d, _, kv = entry
            self._pending_kv[d] -= kv
            self._pending_n[d] -= 1

    def withdraw(self, request_id: str) -> None:
        """Undo the latest ``choose`` if it was for ``request_id`` (shed before it was
        sent): its prefill ledger entry and its decode pairing, or, for a pick made by the
        round-robin fallback, what RoundRobinPolicy.withdraw undoes. Else nothing."""
        # A decode turn the round-robin fallback took for it goes back as round robin
        # gives it back (its prefill turn stays taken); a no-op unless it took one.
        self._fallback.withdraw(request_id)
        last, self._last = self._last, None
        if last is None or last[0] != request_id:
            return
        self.settle(request_id)
        ledger = self._sent.get(last[1])
        if ledger is not None:
            ledger.drop_last(last[2])

    def _fresh(self, worker_id: str, now: float) -> WorkerTelemetry | None:
        entry = self._latest.get(worker_id)
        if entry is None or now - entry[1] > self.stale_after_s:
            return None
        return entry[0]

    def _key(
        self, role: Role, wid: str, tel: WorkerTelemetry, rec: WorkerRecord
    ) -> tuple[float, ...]:
        ledger = self._sent.get(wid)
        n = len(ledger.entries) if ledger else 0
        if role == PREFILL:
            work = ledger.work_s if ledger else 0.0
            return (
                prefill_wait_s(tel.metrics.get("queue_work_s", 0.0), work),
                prefill_score(tel.ppi, work, self.cfg.ttft_s),
                float(tel.queue_len + n),
            )
        n += self._pending_n.get(wid, 0)
        kv = (ledger.kv_tokens if ledger else 0) + self._pending_kv.get(wid, 0)
        blocks = -(-kv // max(1, rec.kv_block_size))
        score = decode_score(
            tel.dpi_adm, blocks, tel.total_blocks, tel.running, n, rec.max_num_seqs
        )
        return (score, float(n), float(blocks - tel.free_blocks))

    def _pick(
        self, role: Role, records: Sequence[WorkerRecord], ids: list[str], now: float
    ) -> tuple[str, bool]:
        """The best worker of ``role`` and whether the round-robin fallback picked it (no
        fresh telemetry from any candidate)."""
        fresh = {w: t for w in ids if (t := self._fresh(w, now)) is not None}
        if not fresh:
            return self._fallback.pick(role, ids), True
        by_id = {r.worker_id: r for r in records}
        # Fresh workers first (rank 0), by their estimated load; the stale ones after, by id.
        best: tuple[int, tuple[float, ...], str] | None = None
        for w in ids:
            tel = fresh.get(w)
            key = (0, self._key(role, w, tel, by_id[w]), w) if tel else (1, (), w)
            if best is None or key < best:
                best = key
        assert best is not None
        return best[2], False

    def _record(self, wid: str, now: float, work_s: float, kv_tokens: int) -> None:
        ledger = self._sent.setdefault(wid, _SentLedger())
        # Bounded: a send older than the staleness limit is reflected by any fresh telemetry,
        # and without fresh telemetry the worker does not rank on its ledger anyway.
        ledger.drop_until(now - self.stale_after_s)
        ledger.add(now, work_s, kv_tokens)

    def choose(
        self,
        prefill: Sequence[WorkerRecord],
        decode: Sequence[WorkerRecord],
        exclude: frozenset[str] = frozenset(),
        *,
        prompt_tokens: int | None = None,
        max_tokens: int | None = None,
        request_id: str | None = None,
        now_mono_s: float | None = None,
    ) -> tuple[str, str]:
        """Pick a pair and count the request against it: on the prefill worker until its
        telemetry shows it; on the decode worker until its telemetry shows it or — with a
        ``request_id`` — until ``settle(request_id)``: a decode worker reserves KV only at
        admission, after the request's wait in the prefill queue, so its telemetry cannot
        show the requests paired with it that are still queued (under load, seconds' worth).
        The caller then settles every id it passes (first token or end) or withdraws it
        (never sent), or it is dropped after ``pending_expiry_s``.
        ``prompt_tokens``/``max_tokens``: the request's sizes (defaults from the config)."""
        now = time.monotonic() if now_mono_s is None else now_mono_s
        cfg = self.cfg
        p_ids = candidate_ids(prefill, exclude, PREFILL)
        d_ids = candidate_ids(decode, exclude, DECODE)
        prompt = cfg.default_prompt_tokens if prompt_tokens is None else prompt_tokens
        out = cfg.default_max_tokens if max_tokens is None else max_tokens
        self._expire_pending(now)
        p, _ = self._pick(PREFILL, prefill, p_ids, now)
        d, d_fallback = self._pick(DECODE, decode, d_ids, now)
        work_s = cfg.prefill_work_s(prompt)
        self._record(p, now, work_s, 0)
        self._last = None if request_id is None else (request_id, p, (now, work_s, 0))
        # d was the fallback's turn: ``withdraw`` gives it back there.
        self._fallback.claim(request_id if d_fallback else None)
        rec = next(r for r in decode if r.worker_id == d)
        kv = admission_kv_tokens(prompt, out, rec.decode_reserve_tokens, rec.max_model_len)
        if request_id is None:
            self._record(d, now, 0.0, kv)
        else:
            self.settle(request_id)  # a retry with the same id replaces its first pairing
            self._pending[request_id] = (d, now, kv)
            self._pending_kv[d] = self._pending_kv.get(d, 0) + kv
            self._pending_n[d] = self._pending_n.get(d, 0) + 1
        return p, d

    def _expire_pending(self, now: float) -> None:
        # Insertion order is send order: the oldest entries are first.
        limit = now - self.cfg.pending_expiry_s
        while self._pending:
            rid, (_, sent, _) = next(iter(self._pending.items()))
            if sent > limit:
                break
            self.settle(rid)


def make_policy(
    name: str,
    stale_after_s: float = 1.0,
    *,
    ttft_s: float = 2.0,
    profile: LatencyProfile | None = None,
) -> RoundRobinPolicy | PressurePolicy:
    """Policy by name (``pressure`` or ``round_robin``). Raises ValueError."""
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "pressure":
        return PressurePolicy(cfg=PressureConfig(stale_after_s, ttft_s, profile))
    raise ValueError(f"unknown pairing policy {name!r}")
