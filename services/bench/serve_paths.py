"""The measuring side of ``fluidpd bench serve`` (serve.py): in a process of its own, request
by request, the same prompt through the router, over the bus, through the stack floor and
to the engine directly, so that every path sees the same machine load. Returns the samples;
serve.py sets up the cluster and reports."""

from __future__ import annotations

import argparse
import logging
import os
from collections import defaultdict
from typing import Any
from urllib.parse import urlsplit

from services.bench.bus_client import BenchBusClient
from services.bench.serve_baselines import DirectEngine
from services.bench.serve_samples import (
    SEED,
    Samples,
    bus_samples,
    direct_samples,
    router_samples,
)
from services.bench.sse_client import SSEClient
from services.common.logging import configure_logging
from shared.aio import run


async def router_request(client: SSEClient, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": SEED,
        "ignore_eos": True,
        "stream": True,
        "fluidpd_timestamps": True,
    }
    resp = await client.post_stream("/v1/completions", body)
    chunks: list[tuple[float, str]] = []
    ext: dict[str, Any] = {}
    for t, chunk in resp.events:
        text = chunk["choices"][0]["text"] if chunk.get("choices") else ""
        chunks.append((t, text))
        ext = chunk.get("fluidpd", ext)
    return {
        "chunks": chunks,
        "walls": resp.event_walls_s,
        "ext": ext,
        "sent_wall": resp.sent_wall_s,
    }


async def floor_request(
    client: SSEClient, prompt: list[int], max_tokens: int
) -> tuple[list[int], list[float]]:
    """One request through the stack floor: (tokens, seconds from send to each)."""
    resp = await client.post_stream("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens})
    tokens = [int(chunk["choices"][0]["text"]) for _, chunk in resp.events]
    return tokens, [t for t, _ in resp.events]


async def run_all_paths(
    url: str,
    floor_url: str,
    nats_url: str,
    prompts: list[list[int]],
    refs: list[list[int]],
    direct_engine: DirectEngine,
    a: Any,
) -> tuple[Samples, Samples, Samples, Samples, int]:
    """Request i goes through the router, over the bus, through the stack floor, then to
    the engine directly: all paths see the same machine load. Returns (router, bus, floor,
    direct samples, inexact streams)."""
    from shared.tokenizer.models import load_tokenizer

    tok = load_tokenizer("tiny")
    routed: Samples = defaultdict(list)
    bus: Samples = defaultdict(list)
    floor: Samples = defaultdict(list)
    direct: Samples = defaultdict(list)
    bad = 0
    router, relay = urlsplit(url), urlsplit(floor_url)
    async with (
        SSEClient(router.hostname or "127.0.0.1", router.port or 80) as http,
        SSEClient(relay.hostname or "127.0.0.1", relay.port or 80) as floor_http,
        BenchBusClient(nats_url) as client,
    ):
        await client.wait_workers(["p0", "d0"])
        for i, (prompt, ref) in enumerate(zip(prompts, refs, strict=True)):
            got = await router_request(http, prompt, a.output_tokens)
            rid = await client.submit("p0", "d0", prompt, a.output_tokens, seed=SEED)
            st = await client.result(rid, timeout_s=60.0)
            floor_tokens, floor_times = await floor_request(floor_http, prompt, a.output_tokens)
            direct_tokens, direct_times = await direct_engine.run(prompt, a.output_tokens)
            if i < a.warmup:
                continue
            n_routed, n_bus = len(routed["ttft_ms"]), len(bus["ttft_ms"])
            n_direct = len(direct["ttft_ms"])
            bad += not router_samples(routed, tok, prompt, ref, got)
            bad += not bus_samples(bus, prompt, ref, st)
            bad += not direct_samples(floor, ref, floor_tokens, floor_times)
            bad += not direct_samples(direct, ref, direct_tokens, direct_times)
            if len(routed["ttft_ms"]) > n_routed and len(bus["ttft_ms"]) > n_bus:
                diff = routed["ttft_ms"][-1] - bus["ttft_ms"][-1]
                routed["router_minus_bus_ttft_ms"].append(diff)  # same request, same load
            if len(routed["ttft_ms"]) > n_routed and len(direct["ttft_ms"]) > n_direct:
                diff = routed["ttft_ms"][-1] - direct["ttft_ms"][-1]
                routed["ttft_added_paired_ms"].append(diff)
                diff = routed["ttft_ms"][-1] - floor["ttft_ms"][-1]
                routed["router_minus_floor_ttft_ms"].append(diff)
    return routed, bus, floor, direct, bad


def init_measuring_process(cpus: tuple[int, ...]) -> None:
    configure_logging(service="bench", level=logging.WARNING)
    if cpus:
        os.sched_setaffinity(0, cpus)


def measure(
    url: str,
    floor_url: str,
    nats_url: str,
    prompts: list[list[int]],
    refs: list[list[int]],
    profile_path: str,
    a: argparse.Namespace,
) -> tuple[Samples, Samples, Samples, Samples, int]:
    """``run_all_paths`` with a direct engine of its own (runs in the measuring process)."""
    direct_engine = DirectEngine(profile_path)
    try:
        result: tuple[Samples, Samples, Samples, Samples, int] = run(
            run_all_paths(url, floor_url, nats_url, prompts, refs, direct_engine, a)
        )
        return result
    finally:
        direct_engine.close()
