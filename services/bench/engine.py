"""``fluidpd bench engine``: prefill and batched decode throughput vs HF ``generate``.

Measures, in one run on this machine: prefill tokens/s; decode tokens/s at batch 1 and 8;
each with 1 and 2 threads; batched decode of our ``generate`` loop beside HF transformers'
greedy ``generate`` on the same weights, both decode-only (generate(N) − generate(1), so
the prompt's prefill cancels out); process
RSS; and the memory-bandwidth floor of a decode step (bytes a step must read — weights plus
KV — divided by this machine's read bandwidth, from a ``torch.sum`` over 512 MiB).
Last line: one JSON object with the figures and both goal ratios.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Callable

import torch

from shared.engine.batch import StepInput
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.generate import generate
from shared.sampling_params import SamplingParams


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _read_bandwidth_gbps(
    nbytes: int = 512 * 1024 * 1024, repeats: int = 5, device: str = "cpu"
) -> float:
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    buf.sum()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        buf.sum()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _decode_step_s(engine: Engine, batch: int, ctx: int, iters: int) -> float:
    bm = engine.block_manager
    ids = [f"b{i}" for i in range(batch)]
    for sid in ids:
        bm.allocate(sid, ctx + iters + 1)
    try:
        steps = [StepInput(sid, list(range(10, 10 + ctx)), 0, bm.block_table(sid)) for sid in ids]
        for s in steps:
            engine.forward([s])
        times = []
        for it in range(iters):
            t0 = time.perf_counter()
            engine.forward([StepInput(sid, [42], ctx + it, bm.block_table(sid)) for sid in ids])
            times.append(time.perf_counter() - t0)
    finally:
        for sid in ids:
            bm.free_sequence(sid)
    times.sort()
    return times[len(times) // 2]


def _prefill_tps(engine: Engine, length: int, repeats: int = 3) -> float:
    bm = engine.block_manager
    bm.allocate("p", length)
    try:
        step = StepInput("p", [(i * 7) % 1000 + 5 for i in range(length)], 0, bm.block_table("p"))
        engine.forward([step])
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.forward([step])
            best = min(best, time.perf_counter() - t0)
    finally:
        bm.free_sequence("p")
    return length / best


def _decode_rate(run: Callable[[int], float], batch: int, new_tokens: int) -> float:
    """Decode-only tokens/s of a generate function: (N − 1) extra tokens per sequence,
    timed as generate(N) − generate(1), so the prompt's prefill cancels out."""
    run(2)  # warm-up
    t_full = min(run(new_tokens) for _ in range(2))
    t_one = min(run(1) for _ in range(2))
    return batch * (new_tokens - 1) / max(t_full - t_one, 1e-9)


def _hf_decode_tps(engine: Engine, batch: int, prompt_len: int, new_tokens: int) -> float | None:
    try:
        import pathlib

        import transformers
    except ImportError:
        return None
    src = pathlib.Path(engine.model_source)
    if src.suffix == ".gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(src.parent), gguf_file=src.name, dtype=torch.float32
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    model.eval()
    ids = torch.tensor([[(i * 7) % 1000 + 5 for i in range(prompt_len)]] * batch)

    def run(n: int) -> float:
        with torch.no_grad():
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            return time.perf_counter() - t0

    return _decode_rate(run, batch, new_tokens)


def _ours_decode_tps(engine: Engine, batch: int, prompt_len: int, new_tokens: int) -> float:
    prompts = [[(i * 7) % 1000 + 5 for i in range(prompt_len)] for _ in range(batch)]

    def run(n: int) -> float:
        t0 = time.perf_counter()
        generate(
            engine,
            prompts,
            SamplingParams(max_tokens=n, ignore_eos=True),
            prefill_chunk_tokens=prompt_len * batch,
        )
        return time.perf_counter() - t0

    return _decode_rate(run, batch, new_tokens)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fluidpd bench engine", description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-iters", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    args = p.parse_args(argv)

    engine = Engine.load(
        EngineConfig(model=args.model, block_size=16, num_kv_blocks=512, device=args.device)
    )
    bw = _read_bandwidth_gbps(device=args.device)
    result: dict[str, object] = {"model": args.model, "read_bandwidth_gbps": round(bw, 2)}
    kv_per_token = engine.model_config.kv_bytes_per_token(engine.cfg.torch_dtype)
    weight_bytes = engine.model.weight_nbytes()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        prefill = _prefill_tps(engine, args.prompt_len)
        d1 = _decode_step_s(engine, 1, args.prompt_len, args.decode_iters)
        d8 = _decode_step_s(engine, 8, args.prompt_len, args.decode_iters)
        result[f"t{threads}"] = {
            "prefill_tokens_per_s": round(prefill, 1),
            "decode_b1_step_ms": round(d1 * 1e3, 2),
            "decode_b1_tokens_per_s": round(1 / d1, 1),
            "decode_b8_step_ms": round(d8 * 1e3, 2),
            "decode_b8_tokens_per_s": round(8 / d8, 1),
        }
        print(json.dumps({f"threads={threads}": result[f"t{threads}"]}), flush=True)
    threads = 2
    torch.set_num_threads(threads)
    floor_s = (weight_bytes + kv_per_token * args.prompt_len) / (bw * 1e9)
    d1 = _decode_step_s(engine, 1, args.prompt_len, args.decode_iters)
    result["decode_floor_ms"] = round(floor_s * 1e3, 2)
    result["b1_step_over_floor"] = round(d1 / floor_s, 2)
    ours = _ours_decode_tps(engine, 8, args.prompt_len, args.new_tokens)
    result["ours_decode_b8_tokens_per_s"] = round(ours, 1)
    if not args.no_hf:
        hf = _hf_decode_tps(engine, 8, args.prompt_len, args.new_tokens)
        if hf:
            result["hf_generate_decode_b8_tokens_per_s"] = round(hf, 1)
            result["batched_decode_vs_hf"] = round(ours / hf, 2)
    result["goals"] = {"batched_decode_vs_hf": ">= 1.5", "b1_step_over_floor": "<= 1.5"}
    result["rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps(result))
    return 0
