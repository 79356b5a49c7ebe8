"""SLO-aware admission at the router (goodput): reject a request with 503 + Retry-After,
before any byte of a 200 is sent, when the TTFT it would see is hopeless.

Predicted TTFT on the prefill worker the router picked = the prefill work queued there
(its telemetry's ``queue_work_s``: Σ T_pre over its queue plus the running prefill's
remainder) + the T_pre of what this router sent it since that telemetry + the request's
own T_pre (eq. 2, with the coefficients the worker publishes: the same predictors as its
PPI). Shed when that exceeds ``ttft_multiple`` × S_TTFT (shared/policy/admission.py, the
rule the simulator applies too). The check runs once the pairing policy has chosen the
request's pair and before anything is sent (services/router/dispatch.py ``submit``'s
``admit``), so it is about the worker the request would wait on — under ``round_robin``
not necessarily the least loaded one — as in the simulator (services/sim/prefill_path.py
``_hopeless``). Without fresh telemetry from that worker nothing is shed: no prediction,
no rejection.

Decode backlog: a request the decode side cannot admit waits for it after its prefill (its
KV held on the prefill worker) and, past the workers' decode-wait timeout, fails after its
200. So the gate also sheds when every Active decode worker with fresh telemetry already
has ``decode_backlog_batches`` × its ``max_num_seqs`` requests waiting for admission
(telemetry ``decode_waiting``): a newcomer would wait at least that many batch turnovers
(``sheds_for_decode_backlog``, the rule the simulator applies too).
Event loop only; mutates its own views and ledgers.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from services.router.errors import Unavailable
from shared.engine.profiles import load_profile
from shared.messages import WorkerRecord, WorkerTelemetry
from shared.policy.admission import (
    SheddingConfig,
    least_decode_backlog_batches,
    predicted_ttft_s,
    retry_after_s,
    sheds_for_decode_backlog,
    should_shed,
)
from shared.policy.predictors import LatencyProfile
from shared.policy.roles import DECODE, PREFILL

TELEMETRY_LAG_S = 0.005  # a message received at t reflects the sends made up to t - this


@dataclass
class _PrefillView:
    received_s: float  # our monotonic clock
    queue_work_s: float
    profile: LatencyProfile
    sent: deque[tuple[float, float]]  # (send time, T_pre s) not yet in its telemetry
    sent_work_s: float = 0.0

    def drop_until(self, t: float) -> None:
        while self.sent and self.sent[0][0] <= t:
            self.sent_work_s -= self.sent.popleft()[1]
        if not self.sent:
            self.sent_work_s = 0.0


class Overloaded(Unavailable):
    """503 with Retry-After: the request's predicted TTFT is beyond the shedding limit."""

    code = "overloaded"


class AdmissionGate:
    """The router's shedding decision (module doc) under ``shedding``: its
    ``ttft_multiple`` and ``decode_backlog_batches`` (0 turns either rule off; its
    ``expire_margin_s`` is the prefill workers' business). ``decode_records()`` lists the
    Active decode workers (registry)."""

    def __init__(
        self,
        shedding: SheddingConfig,
        ttft_slo_s: float,
        *,
        stale_after_s: float = 1.0,
        profile: LatencyProfile | None = None,
        decode_records: Callable[[], Iterable[WorkerRecord]] | None = None,
    ) -> None:
        self._decode_records = decode_records
        self._decode_waiting: dict[str, tuple[float, float]] = {}  # id -> (mono s, waiting)
        self.shedding = shedding
        self.ttft_slo_s = ttft_slo_s
        self.stale_after_s = stale_after_s
        self._base = profile or load_profile("")
        self._views: dict[str, _PrefillView] = {}
        self.shed_total = 0

    def observe(self, msg: WorkerTelemetry, now_s: float | None = None) -> None:
        """A worker's telemetry (bus callback): keep a prefill worker's queued work."""
        now = time.monotonic() if now_s is None else now_s
        wid = msg.publisher_id
        if msg.role == DECODE:
            self._decode_waiting[wid] = (now, msg.metrics.get("decode_waiting", 0.0))
        else:
            self._decode_waiting.pop(wid, None)
        if msg.role != PREFILL or "queue_work_s" not in msg.metrics:
            self._views.pop(wid, None)
            return
        m = msg.metrics
        view = self._views.get(wid)
        profile = view.profile if view is not None else self._base
        c1 = m.get("prefill_c1_s_per_token", profile.prefill_c1_s_per_token)
        c0 = m.get("prefill_c0_s", profile.prefill_c0_s)
        if (c1, c0) != (profile.prefill_c1_s_per_token, profile.prefill_c0_s) and c1 > 0:
            profile = dataclasses.replace(profile, prefill_c1_s_per_token=c1, prefill_c0_s=c0)
        if view is None:
            view = self._views[wid] = _PrefillView(now, m["queue_work_s"], profile, deque())
        view.received_s, view.queue_work_s, view.profile = now, m["queue_work_s"], profile
        view.drop_until(now - TELEMETRY_LAG_S)

    def note_sent(self, prefill_id: str, prompt_tokens: int, now_s: float | None = None) -> None:
        """The router handed a prompt to ``prefill_id``: count it until telemetry shows it."""
        view = self._views.get(prefill_id)
        if view is None:
            return
        now = time.monotonic() if now_s is None else now_s
        work_s = max(0.0, view.profile.prefill_time_s(prompt_tokens))
        view.drop_until(now - self.stale_after_s)  # bounded
        view.sent.append((now, work_s))
        view.sent_work_s += work_s

    def predict_s(
        self, prompt_tokens: int, prefill_id: str, now_s: float | None = None
    ) -> float | None:
        """Predicted TTFT of a ``prompt_tokens`` prompt sent to ``prefill_id`` now (None:
        no fresh telemetry from it, no prediction). Mutates nothing."""
        now = time.monotonic() if now_s is None else now_s
        view = self._views.get(prefill_id)
        if view is None or now - view.received_s > self.stale_after_s:
            return None
        ahead = view.queue_work_s + view.sent_work_s
        return predicted_ttft_s(ahead, prompt_tokens, view.profile)

    def decode_backlog(self, now_s: float | None = None) -> float | None:
        """The smallest decode backlog (requests waiting for admission / ``max_num_seqs``)
        over the Active decode workers with fresh telemetry; None when there is none."""
        if self._decode_records is None:
            return None
        now = time.monotonic() if now_s is None else now_s
        fresh = []
        for rec in self._decode_records():
            seen = self._decode_waiting.get(rec.worker_id)
            if seen is not None and now - seen[0] <= self.stale_after_s:
                fresh.append((seen[1], rec.max_num_seqs))
        return least_decode_backlog_batches(fresh)

    def check(self, prompt_tokens: int, prefill_id: str, now_s: float | None = None) -> None:
        """The door decision for a request about to be sent to ``prefill_id`` (the prefill
        worker its pair names). Raises Overloaded (503, Retry-After) when it should be shed
        (counted in ``shed_total``); else returns and changes nothing."""
        if self.shedding.decode_backlog_batches > 0:  # else: no need to look at decode
            backlog = self.decode_backlog(now_s)
            if backlog is not None and sheds_for_decode_backlog(backlog, self.shedding):
                self.shed_total += 1
                raise Overloaded(
                    f"the server is overloaded: every decode worker already has "
                    f"{backlog:.1f} batches of requests waiting for it; retry later",
                    retry_after_s=max(1, round(backlog)),
                )
        if not self.shedding.sheds:
            return
        predicted = self.predict_s(prompt_tokens, prefill_id, now_s)
        if predicted is None or not should_shed(predicted, self.ttft_slo_s, self.shedding):
            return
        self.shed_total += 1
        limit_s = self.shedding.ttft_multiple * self.ttft_slo_s
        raise Overloaded(
            f"the server is overloaded: predicted time to first token {predicted:.1f} s "
            f"exceeds the limit of {limit_s:.1f} s; retry later",
            retry_after_s=retry_after_s(predicted, self.ttft_slo_s, self.shedding),
        )
