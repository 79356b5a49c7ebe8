"""``fluidpd calibrate``: profile the torch engine here and write a latency profile (JSON).

Times prefills of several lengths (eq. 2), suffix chunks on several context lengths, and
decode iterations over batch sizes and contexts (eq. 13), then fits the predictors by least
squares. The JSON is the format the emulated engine and the policies read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from shared.engine.batch import StepInput
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.policy.calibration import fit_profile, mean_relative_error
from shared.policy.predictors import LatencyProfile


def _timed(engine: Engine, steps: list[StepInput], repeats: int) -> float:
    engine.forward(steps)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.forward(steps)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(engine: Engine, repeats: int, max_len: int) -> tuple[list, list, list]:
    bm = engine.block_manager
    bm.allocate("cal", max_len * 2)
    table = bm.block_table("cal")
    prefill, suffix, decode = [], [], []
    try:
        lengths = sorted({max(1, max_len * k // 8) for k in range(1, 9)})
        for n in lengths:
            prefill.append((n, _timed(engine, [StepInput("cal", [5] * n, 0, table)], repeats)))
        for ctx in (max_len // 4, max_len // 2, max_len):
            for n in (max(2, max_len // 16), max(2, max_len // 4)):
                t = _timed(engine, [StepInput("cal", [5] * n, ctx, table)], repeats)
                suffix.append((n, ctx, t))
    finally:
        bm.free_sequence("cal")
    for batch in (1, 2, 4, 8, 16):
        for ctx in (max_len // 8, max_len // 2):
            ids = [f"d{i}" for i in range(batch)]
            for sid in ids:
                bm.allocate(sid, ctx + 1)
            try:
                steps = [StepInput(sid, [7], ctx, bm.block_table(sid)) for sid in ids]
                decode.append((batch, batch * (ctx + 1), _timed(engine, steps, repeats)))
            finally:
                for sid in ids:
                    bm.free_sequence(sid)
    return prefill, suffix, decode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fluidpd calibrate", description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--max-len", type=int, default=512, help="longest prompt/context timed")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="", help="write the profile here (default: stdout only)")
    args = p.parse_args(argv)
    engine = Engine.load(
        EngineConfig(
            model=args.model,
            num_threads=args.threads,
            num_kv_blocks=16 * (args.max_len // 16 + 2) + 64,
        )
    )
    prefill, suffix, decode = measure(engine, args.repeats, args.max_len)
    mc = engine.model_config
    base = LatencyProfile(
        model=args.model,
        hardware=f"cpu, {engine.describe()['threads']} threads (torch)",
        prefill_c1_s_per_token=1e-4,
        prefill_c0_s=0.0,
        suffix_s1_s_per_token=1e-4,
        suffix_attn_s_per_token_pair=0.0,
        suffix_s0_s=0.0,
        decode_ac_s_per_ctx_token=0.0,
        decode_an_s_per_seq=0.0,
        decode_a0_s=0.0,
        kv_bytes_per_token=mc.kv_bytes_per_token(engine.cfg.torch_dtype),
        kv_capacity_tokens=engine.arena.num_blocks * engine.cfg.block_size,
        max_context_tokens=engine.max_model_len,
    )
    profile = fit_profile(
        base,
        prefill,
        suffix,
        decode,
        derivation=f"fluidpd calibrate --model {args.model} --max-len "
        f"{args.max_len}: OLS over {len(prefill)} prefill, "
        f"{len(suffix)} suffix, {len(decode)} decode timings",
    )
    err = mean_relative_error(
        [profile.prefill_time_s(n) for n, _ in prefill], [t for _, t in prefill]
    )
    if args.out:
        profile.save(args.out)
    print(
        json.dumps(
            {
                "profile": profile.to_dict(),
                "prefill_fit_mean_rel_error": round(err, 4),
                "out": args.out or None,
            }
        )
    )
    return 0
