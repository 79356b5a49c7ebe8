"""Simulated requests and workers: the state the real worker keeps, without processes.

A ``SimWorker`` has both sides, like the real dual-role runtime: a prefill side (FIFO queue,
the request being admitted/computed, its KV link) and a decode side (reservations, installed
requests, continuous batching). ``role`` says which side serves.

The decode side never touches each running request per iteration (that would cost
O(tokens)): a request that joins the decode batch before iteration k0 with n0 tokens has
n0 + (k − k0) tokens before iteration k, so the batch's aggregate context (eq. 13's C) is
S + N·k with S = Σ (n0 − k0), and its last token comes out of iteration
k0 + (output_tokens − outputs_at_join) − 1, kept in a heap. Entries of requests that left
(migration) are skipped through an epoch counter.
"""

from __future__ import annotations

import heapq
from collections import deque

from shared.policy.admission import queue_work_s
from shared.policy.busy import BusyClock, BusyMeter
from shared.policy.predictors import LatencyProfile
from shared.policy.roles import ACTIVE, DECODE, PREFILL


class SimRequest:
    """One request's life. Mutated by the simulation; times are simulated seconds."""

    __slots__ = (
        "arrival_s",
        "blocks",
        "computed",
        "decode_id",
        "done",
        "dw",
        "epoch",
        "expired",
        "failed",
        "idx",
        "k0",
        "kf",
        "local_blocks",
        "n0",
        "ntok",
        "output",
        "outs",
        "prefix",
        "prompt",
        "prompt_tokens",
        "pw",
        "rejected",
        "request_id",
        "reserve_blocks",
        "reserve_kv_tokens",
        "sfx_done",
        "source",
        "suffix",
        "t_first",
        "t_last",
        "wait_since",
        "window",
    )

    def __init__(
        self,
        idx: int,
        arrival_s: float,
        prompt: int,
        output: int,
        source: str,
        window: int,
        *,
        reserve_kv_tokens: int = 0,
        reserve_blocks: int = 0,
    ) -> None:
        self.idx = idx
        self.arrival_s = arrival_s
        self.prompt = prompt
        self.output = output
        self.source = source
        self.window = window
        self.pw = -1  # prefill worker index
        self.dw = -1  # decode worker index
        # The policy's view while queued: the fields of shared.policy's QueuedRequest, so
        # queue_ppi and select_steal_ratios read the queue itself (no per-tick copies).
        self.request_id = f"r{idx}"
        self.prompt_tokens = prompt
        self.decode_id = ""
        # What a decode worker reserves when it admits this request (admission_kv_tokens,
        # and in whole blocks): fixed per request, so computed once when it is created.
        self.reserve_kv_tokens = reserve_kv_tokens
        self.reserve_blocks = reserve_blocks
        self.blocks = 0  # KV blocks reserved/held on the decode worker
        # Prefill side: blocks its prompt (prefix) KV holds there from the start of its
        # prefill until the transfer ends; whether that prefill is done; since when it
        # waits for decode admission (refused for capacity; -1 = not waiting).
        self.local_blocks = 0
        self.computed = False
        self.wait_since = -1.0
        self.suffix = 0  # stolen tokens (L_sfx)
        self.prefix = prompt
        self.sfx_done = 0
        self.ntok = 0  # tokens in the sequence when it (re)joins a decode batch
        self.outs = 0  # output tokens produced when it (re)joins
        self.k0 = 0
        self.n0 = 0
        self.kf = 0
        self.epoch = 0
        self.t_first = -1.0
        self.t_last = -1.0
        self.failed = False  # not completed (any reason below included)
        self.rejected = False  # shed at the router's door (admission.should_shed)
        self.expired = False  # dropped from a prefill queue past deadline + margin
        self.done = False


class SimWorker:
    """Both sides of one worker. Plain attributes, mutated by the simulation."""

    def __init__(self, index: int, role: str, num_blocks: int, busy_window_s: float) -> None:
        self.index = index
        self.wid = f"w{index:03d}"
        self.role = role
        self.state = ACTIVE
        self.target_role = ""
        self.switch_epoch = 0
        self.drain_started_s = 0.0
        self.migrate_pending = False
        # Prefill side (PrefillRole).
        self.queue: deque[SimRequest] = deque()
        self.current: SimRequest | None = None
        # Seconds spent computing prompts (started with ``current``, stopped when it is done).
        self.busy_clock = BusyClock()
        # Requests refused for capacity and retried (admission.py's ``waiting``), by idx;
        # computed ones hold their KV here. ``local_blocks``: prompt KV held here (being
        # computed, waiting for admission, or on the wire), part of the one block pool.
        self.adm_waiting: dict[int, SimRequest] = {}
        self.local_blocks = 0
        self.link_free_s = 0.0  # KV exports/migrations leave over one serialised link
        # Decode side (DecodeRole).
        self.num_blocks = num_blocks
        self.held_blocks = 0  # installed requests (prompt + max_tokens reservation each)
        self.reserved_blocks = 0  # admitted, KV not yet installed
        self.requests = 0  # receiving + runnable (DecodeRole.requests)
        self.receiving = 0
        self.admitting = True
        self.busy = False  # a decode iteration is running
        self.k = 0  # completed decode iterations
        self.n_dec = 0  # requests in the decode batch (N)
        self.s_ctx = 0  # Σ (n0 − k0) over the decode batch
        self.finish_heap: list[tuple[int, int, int, SimRequest]] = []
        self.pending: list[SimRequest] = []  # installed, join at the next iteration
        self.pending_tokens = 0
        self.suffixes: list[SimRequest] = []  # split requests running their suffix
        self.suffix_tokens = 0  # Σ prompt of those (their num_tokens)
        self.suffix_backlog = 0  # accepted suffix tokens not computed yet (incl. receiving)
        self.iter_chunks: list[tuple[SimRequest, int]] = []
        # Latest telemetry (what peers, the router and the controller see).
        self.ppi = 0.0
        # The prefill busy fraction (FluidRole's P->D bound): sampled at telemetry ticks in
        # the prefill role, cleared in the decode role, like the live worker's telemetry.
        self.busy_meter = BusyMeter(busy_window_s)
        self.prefill_busy_frac = 0.0  # busy_meter.fraction() at the last telemetry tick
        self.dpi_load = 0.0
        self.dpi_adm = 0.0
        self.queue_len_tel = 0
        self.queue_work_tel = 0.0  # prefill: queue_work_s at the last tick (the door's view)
        self.free_blocks_tel = num_blocks
        self.running_tel = 0
        # Requests refused for capacity and retried by their prefill workers (the live
        # decode worker's WaitingAdmissions): counted at each telemetry tick.
        self.waiting_tel = 0
        self.waiting_kv_tel = 0
        self.sent_since = 0  # router: requests sent since the last telemetry
        # Decode flow counters (the live worker's decode_entered_total / decode_left_total,
        # shared/policy/decode_flow.py): a request enters when its KV is installed (prefill
        # hand-off or migration) and leaves when it finishes or migrates away.
        self.dec_entered = 0
        self.dec_left = 0

    # ----------------------------------------------------------------- views
    @property
    def free_blocks(self) -> int:
        return self.num_blocks - self.held_blocks - self.reserved_blocks - self.local_blocks

    @property
    def running(self) -> int:
        """len(DecodeRole.runnable): decode batch, pending joiners and suffixes."""
        return self.n_dec + len(self.pending) + len(self.suffixes)

    def active_tokens(self) -> int:
        """Σ num_tokens over runnable requests (the real telemetry's C_active)."""
        return self.s_ctx + self.n_dec * self.k + self.pending_tokens + self.suffix_tokens

    def queue_len(self) -> int:
        return len(self.queue) + (1 if self.current is not None else 0)

    def queued_work_s(self, profile: LatencyProfile) -> float:
        """Prefill work ahead of a newcomer (admission.queue_work_s, the live worker's
        telemetry ``queue_work_s``): Σ T_pre over the queue plus the running prompt's whole
        T_pre (the simulator does not track a running prefill's remainder)."""
        running_s = profile.prefill_time_s(self.current.prompt) if self.current is not None else 0.0
        return queue_work_s((r.prompt for r in self.queue), profile, running_remaining_s=running_s)

    def is_active(self, role: str) -> bool:
        return self.role == role and self.state == ACTIVE

    # ------------------------------------------------------------ decode side
    def join_pending(self) -> None:
        """Move installed requests into the decode batch before iteration ``k``."""
        k = self.k
        for r in self.pending:
            r.k0, r.n0 = k, r.ntok
            r.kf = k + (r.output - r.outs) - 1
            self.s_ctx += r.ntok - k
            self.n_dec += 1
            heapq.heappush(self.finish_heap, (r.kf, r.idx, r.epoch, r))
        self.pending.clear()
        self.pending_tokens = 0

    def leave_batch(self, r: SimRequest) -> None:
        """Take ``r`` out of the decode batch (finished or migrating); its heap entry, if
        any, goes stale. Updates ``r.ntok``/``r.outs`` to its state now."""
        r.ntok = r.n0 + (self.k - r.k0)
        r.outs = r.ntok - r.prompt
        self.s_ctx -= r.n0 - r.k0
        self.n_dec -= 1
        r.epoch += 1

    def release(self, r: SimRequest) -> None:
        """Free ``r``'s blocks (finish or migration away); it leaves the decode flow."""
        self.held_blocks -= r.blocks
        self.requests -= 1
        self.dec_left += 1

    def batch_members(self) -> list[SimRequest]:
        """Requests in the decode batch now, in finish order (allocates; migration only)."""
        return [
            r
            for _, _, epoch, r in sorted(self.finish_heap)
            if r.epoch == epoch and r.dw == self.index and not r.done
        ]


def initial_workers(
    n: int, n_prefill: int, num_blocks: int, busy_window_s: float
) -> list[SimWorker]:
    """Workers 0..n_prefill-1 start as prefill, the rest as decode."""
    return [
        SimWorker(i, PREFILL if i < n_prefill else DECODE, num_blocks, busy_window_s)
        for i in range(n)
    ]
