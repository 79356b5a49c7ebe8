"""``fluidpd generate``: the single-process ground truth (no bus, no transfer)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from shared.engine.defaults import check_device_name
from shared.errors import FluidPDError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fluidpd generate", description=__doc__)
    p.add_argument("--model", default="smollm2-135m", help="tiny | tiny-gpu | smollm2-135m | PATH")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument(
        "--device",
        default=os.environ.get("FLUIDPD_DEVICE", "cpu"),
        help="cpu | cuda | cuda:N (env FLUIDPD_DEVICE); dtype follows it (bf16 on CUDA)",
    )
    p.add_argument("--json", action="store_true", help='print {"token_ids": [...], "text": ...}')
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="with --json: each output and prompt token's raw logprob and the top K (0..20)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_device_name(args.device)
    except ValueError as exc:
        parser.error(f"--{exc}")
    if args.device != "cpu":
        import torch

        if not torch.cuda.is_available():
            print(
                f"fluidpd generate: error: --device {args.device}: no CUDA device", file=sys.stderr
            )
            return 2
    try:
        return _run(args)
    except FluidPDError as exc:
        print(f"fluidpd generate: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from shared.engine.config import EngineConfig
    from shared.engine.engine import Engine
    from shared.engine.generate import generate
    from shared.sampling_params import SamplingParams
    from shared.stop_strings import apply_stop_strings

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        prompt_logprobs=args.logprobs,
    )
    engine = Engine.load(
        EngineConfig(model=args.model, num_threads=args.threads, device=args.device)
    )
    tok = engine.tokenizer
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        text = args.prompt
    prompt_ids = tok.encode(text)
    out = generate(engine, [prompt_ids], params)[0]
    token_ids, text_out, _ = apply_stop_strings(tok, out.token_ids, params.stop)
    if args.json:
        doc: dict[str, object] = {
            "token_ids": token_ids,
            "text": text_out,
            "finish_reason": out.finish_reason,
        }
        if args.logprobs is not None:
            doc["prompt_token_ids"] = prompt_ids
            doc["logprobs"] = [_lp_json(lp) for lp in out.logprobs[: len(token_ids)]]
            doc["prompt_logprobs"] = [_lp_json(lp) for lp in out.prompt_logprobs]
        print(json.dumps(doc))
    else:
        print(text_out)
    return 0


def _lp_json(lp: object) -> dict[str, object] | None:
    """``{"logprob": x, "top": [[id, logprob], ...]}`` (None for the first prompt token)."""
    from shared.engine.logprobs import Logprob

    if not isinstance(lp, Logprob):
        return None
    return {
        "logprob": lp.logprob,
        "top": [list(t) for t in zip(lp.top_ids, lp.top_logprobs, strict=True)],
    }
