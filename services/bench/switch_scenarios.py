"""The two switches ``fluidpd bench switch`` (services/bench/switch.py) measures on a running
cluster, each under load: D→P with long decodes in flight (migrated or drained), and P→D
with a prefill running and prompts queued (handed off). Each returns one row of figures.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass
from typing import Any

from services.bench.bus_client import BenchBusClient
from shared.policy.roles import ACTIVE, DECODE, PREFILL, Role

PHASES = ("drain_ms", "reslice_ms", "route_update_ms")


@dataclass(frozen=True)
class Setup:
    """Load shape for one engine (the presets: ``setups`` in switch.py)."""

    engine: str  # ClusterSpec engine
    threads: int
    p2d_prompts: int
    p2d_prompt_tokens: int
    d2p_requests: int
    d2p_prompt_tokens: int
    d2p_output_tokens: tuple[int, int]


def prompt_of(index: int, length: int) -> list[int]:
    return [4 + (index * 131 + i * 17) % 300 for i in range(length)]


# ------------------------------------------------------------------------ one switch
async def switch_and_measure(
    c: BenchBusClient, worker: str, to_role: Role, timeout_s: float
) -> dict[str, Any]:
    """Send the command, wait for the ``active`` event, the registry and the telemetry with
    the new durations. Raises RuntimeError when the worker refuses or cancels the switch."""
    assert c.watcher is not None
    before = c.telemetry[worker].metrics.get("switches_total", 0.0)
    first_event = len(c.events)
    t_cmd, t_cmd_wall = time.perf_counter(), time.time()
    reply = await c.switch(worker, to_role)
    if not reply.ok:
        raise RuntimeError(f"switch {worker} -> {to_role} refused: {reply.error}")

    def active() -> Any:
        for ev in c.events[first_event:]:
            e = ev.event
            if e.publisher_id == worker and e.to_state == ACTIVE:
                return ev
        return None

    await c.wait_until(lambda: active() is not None, timeout_s)
    done = active()
    observed_ms = round((done.recv_s - t_cmd) * 1e3, 3)
    if done.event.role != to_role:  # the drain deadline passed: the worker stayed as it was
        print(f"  switch of {worker} cancelled: {done.event.reason}", file=sys.stderr)
        return {
            **{k: 0.0 for k in PHASES},
            "drain_ms": observed_ms,
            "total_ms": observed_ms,
            "command_to_active_ms": observed_ms,
            "command_to_registry_ms": observed_ms,
            "cancelled": 1,
            "_t_cmd_wall": t_cmd_wall,
            "_t_active_wall": done.recv_wall_s,
        }
    await c.watcher.wait_until(
        lambda w: (r := w.get(worker)) is not None and r.role == to_role and r.state == ACTIVE,
        10.0,
    )
    t_registry = time.perf_counter()
    await c.wait_until(
        lambda: c.telemetry[worker].metrics.get("switches_total", 0.0) > before, 10.0
    )
    m = c.telemetry[worker].metrics
    out = {k: round(m.get(f"switch_{k}", float("nan")), 3) for k in PHASES}
    out["total_ms"] = round(sum(out[k] for k in PHASES), 3)
    out["command_to_active_ms"] = observed_ms
    out["command_to_registry_ms"] = round((t_registry - t_cmd) * 1e3, 3)
    out["cancelled"] = 0
    out["_t_cmd_wall"] = t_cmd_wall
    out["_t_active_wall"] = done.recv_wall_s
    return out


async def wait_idle(c: BenchBusClient, workers: list[str]) -> None:
    """Until no decode work runs or is being received anywhere (telemetry)."""
    await c.wait_until(
        lambda: all(
            w in c.telemetry
            and c.telemetry[w].running == 0
            and c.telemetry[w].metrics.get("receiving", 0.0) == 0
            and c.telemetry[w].queue_len == 0
            for w in workers
        ),
        120.0,
    )


# -------------------------------------------------------------------------- scenarios
async def d2p_under_load(
    c: BenchBusClient, s: Setup, worker: str, rng: random.Random, all_workers: list[str]
) -> dict[str, Any]:
    lo, hi = s.d2p_output_tokens
    lengths = [rng.randint(lo, hi) for _ in range(s.d2p_requests)]
    rids = [
        await c.submit("p0", worker, prompt_of(i, s.d2p_prompt_tokens), n, seed=i)
        for i, n in enumerate(lengths)
    ]
    await c.wait_until(lambda: all(len(c.streams[r].token_ids) >= 5 for r in rids), 120.0)
    moved_before = c.telemetry[worker].metrics.get("migrations_out_total", 0.0)
    remaining = [n - len(c.streams[r].token_ids) for r, n in zip(rids, lengths, strict=True)]
    out = await switch_and_measure(c, worker, PREFILL, timeout_s=120.0)
    got = {r: len(c.streams[r].token_ids) for r in rids}
    # Streams must go on (migrated) or be complete (drained): none may fail.
    await c.wait_until(
        lambda: all(
            c.streams[r].finish_reason is not None or len(c.streams[r].token_ids) > got[r]
            for r in rids
        ),
        30.0,
    )
    errors = sum(1 for r in rids if c.streams[r].error is not None)
    out |= {
        "requests": len(rids),
        "remaining_tokens_max": max(remaining),
        "migrated": int(
            c.telemetry[worker].metrics.get("migrations_out_total", 0.0) - moved_before
        ),
        "errors": errors,
    }
    for r in rids:  # the migrated ones would run for many seconds more: end them
        if c.streams[r].finish_reason is None:
            await c.cancel(r, [w for w in all_workers if w != "p0"])
    await wait_idle(c, all_workers)
    return out


async def p2d_under_load(
    c: BenchBusClient, s: Setup, worker: str, all_workers: list[str]
) -> dict[str, Any]:
    rids = [
        await c.submit(worker, "d0", prompt_of(100 + i, s.p2d_prompt_tokens), 4, seed=i)
        for i in range(s.p2d_prompts)
    ]
    # Right after the first prompt's first token, the worker is running the second prefill.
    await c.wait_until(lambda: len(c.streams[rids[0]].token_ids) >= 1, 60.0)
    out = await switch_and_measure(c, worker, DECODE, timeout_s=60.0)
    for r in rids:
        await c.result(r, 120.0)
    t_cmd = out["_t_cmd_wall"]
    ends = [
        st.timestamps["prefill_end_s"]
        for st in (c.streams[r] for r in rids)
        if st.publishers and st.publishers[0] == worker and "prefill_end_s" in st.timestamps
    ]
    running_end = max([t_cmd, *ends])
    out |= {
        "requests": len(rids),
        "handed_off": sum(1 for r in rids if c.streams[r].publishers[:1] == ["p0"]),
        "running_prefill_remaining_ms": round((running_end - t_cmd) * 1e3, 3),
        "overhead_beyond_prefill_ms": round((out["_t_active_wall"] - running_end) * 1e3, 3),
        "errors": sum(1 for r in rids if c.streams[r].error is not None),
    }
    await wait_idle(c, all_workers)
    return out
