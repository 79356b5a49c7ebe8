"""Open-loop HTTP load generator: arrivals never wait for responses.

Each request is sent at its scheduled arrival time (relative to the run start) as a
streaming ``/v1/completions`` call with a prompt of token ids and ``ignore_eos`` so it
produces exactly ``output_tokens`` tokens. Per request it records the arrival, the time of
every streamed chunk, the completion or the error. TTFT and TPOT follow the paper:
TTFT = first token − arrival; TPOT = (last token − first token) / (tokens − 1).

Token times: the router can return its per-token receive times (``fluidpd_timestamps``);
they are used when present (chunk times merge tokens whose text is held back for UTF-8),
and ``validate_server_times`` compares them with client chunk times on a sample.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp


@dataclass(frozen=True)
class PlannedRequest:
    arrival_s: float  # relative to the start of the run
    prompt_tokens: int
    output_tokens: int
    label: str = ""  # e.g. the workload window it belongs to


@dataclass
class RequestRecord:
    index: int
    label: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    sent_s: float = 0.0
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_tokens: int = 0
    chunk_times_s: list[float] = field(default_factory=list)
    server_token_times_s: list[float] = field(default_factory=list)
    error: str | None = None
    status: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_s is None or self.last_token_s is None or self.num_tokens < 2:
            return None
        return (self.last_token_s - self.first_token_s) / (self.num_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("chunk_times_s")
        d.pop("server_token_times_s")
        d["ttft_s"] = self.ttft_s
        d["tpot_s"] = self.tpot_s
        return d


def prompt_ids(index: int, length: int, vocab_size: int, skip: int = 4) -> list[int]:
    """A deterministic prompt of ``length`` token ids (no special tokens)."""
    rng = random.Random(index * 7919 + length)
    return [rng.randrange(skip, vocab_size) for _ in range(length)]


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    rec: RequestRecord,
    vocab_size: int,
    t0: float,
    timeout_s: float,
) -> None:
    body = {
        "model": model,
        "prompt": prompt_ids(rec.index, rec.prompt_tokens, vocab_size),
        "max_tokens": rec.output_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "fluidpd_timestamps": True,
    }
    rec.sent_s = time.monotonic() - t0
    wall_t0 = time.time() - (time.monotonic() - t0)  # wall clock of the run start
    try:
        async with session.post(
            f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            rec.status = resp.status
            if resp.status != 200:
                rec.error = f"http {resp.status}: {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                now = time.monotonic() - t0
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                    return
                rec.chunk_times_s.append(now)
                ext = chunk.get("fluidpd")
                if ext and ext.get("token_receive_s"):
                    rec.server_token_times_s = [t - wall_t0 for t in ext["token_receive_s"]]
    except (TimeoutError, aiohttp.ClientError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
        return
    times = rec.server_token_times_s or rec.chunk_times_s
    rec.num_tokens = len(rec.server_token_times_s) or len(rec.chunk_times_s)
    if times:
        rec.first_token_s, rec.last_token_s = times[0], times[-1]


async def run_open_loop(
    url: str,
    model: str,
    plan: Sequence[PlannedRequest],
    *,
    vocab_size: int,
    timeout_s: float = 600.0,
    progress: bool | None = None,
) -> list[RequestRecord]:
    """Send every planned request at its arrival time; return one record per request."""
    records = [
        RequestRecord(i, p.label, p.arrival_s, p.prompt_tokens, p.output_tokens)
        for i, p in enumerate(plan)
    ]
    show = sys.stderr.isatty() if progress is None else progress
    done = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.monotonic()
        tasks = []
        for rec in records:
            delay = rec.arrival_s - (time.monotonic() - t0)
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival schedule itself, not a sync
            tasks.append(
                asyncio.ensure_future(_one(session, url, model, rec, vocab_size, t0, timeout_s))
            )
        for fut in asyncio.as_completed(tasks):
            await fut
            done += 1
            if show:
                print(f"\r{done}/{len(records)} requests done", end="", file=sys.stderr)
        if show:
            print(file=sys.stderr)
    return records


def summarize(
    records: Sequence[RequestRecord], slo_ttft_ms: float, slo_tpot_ms: float
) -> dict[str, Any]:
    """Attainment fractions over all requests (an errored request misses both SLOs), and
    ``tpot_missed_after_ttft``: how many met the TTFT SLO but not the TPOT one."""
    n = len(records)
    ok = [r for r in records if r.error is None and r.ttft_s is not None]
    ttft_ok = [r for r in ok if r.ttft_s is not None and r.ttft_s * 1e3 <= slo_ttft_ms]
    tpot_ok = [r for r in ok if r.tpot_s is None or r.tpot_s * 1e3 <= slo_tpot_ms]
    joint = [r for r in ttft_ok if r.tpot_s is None or r.tpot_s * 1e3 <= slo_tpot_ms]
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)

    def pct(xs: list[float], q: float) -> float | None:
        return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 2) if xs else None

    return {
        "requests": n,
        "completed": len(ok),
        "errors": n - len(ok),
        "ttft_attainment": round(len(ttft_ok) / n, 4) if n else 0.0,
        "tpot_attainment": round(len(tpot_ok) / n, 4) if n else 0.0,
        "joint_attainment": round(len(joint) / n, 4) if n else 0.0,
        "tpot_missed_after_ttft": len(ttft_ok) - len(joint),
        "ttft_p50_ms": pct(ttfts, 0.5),
        "ttft_p95_ms": pct(ttfts, 0.95),
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
    }


def validate_server_times(records: Sequence[RequestRecord], sample: int = 20) -> dict[str, Any]:
    """Server token times vs client chunk times on a sample: the last token's gap (ms)."""
    gaps = []
    for rec in [r for r in records if r.server_token_times_s and r.chunk_times_s][:sample]:
        gaps.append((rec.chunk_times_s[-1] - rec.server_token_times_s[-1]) * 1e3)
    gaps.sort()
    return {
        "sampled": len(gaps),
        "last_token_client_minus_server_ms_p50": gaps[len(gaps) // 2] if gaps else None,
        "max_ms": gaps[-1] if gaps else None,
    }
