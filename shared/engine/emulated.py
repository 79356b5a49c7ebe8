"""The emulated engine: the torch engine's interface, with time from a latency profile.

Computes nothing. Each ``step`` sleeps for what the profile predicts (prefill eq. 2, suffix
chunks, decode iteration eq. 13) and returns deterministic pseudo-random token ids of the
model's tokenizer. Everything around it is real: block accounting and reservations (capacity
from the profile), KV bytes (scaled down per token so eight workers fit in a laptop's memory,
but really written, checksummed and transferred), telemetry and the bus.

Token ids are a pure function of (seed, token index, previous token), so the disaggregated,
split and migrated paths reproduce ``fluidpd generate --engine emulated`` exactly.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from shared.engine.batch import StepInput
from shared.engine.block_manager import BlockManager
from shared.engine.engine import SampleSpec
from shared.engine.kv_arena import KVArena
from shared.engine.logprobs import Logprob, PromptLogprobsSpec, StepOutput
from shared.errors import ContextLengthError
from shared.policy.predictors import LatencyProfile

if TYPE_CHECKING:
    from shared.tokenizer import Tokenizer


@dataclass(frozen=True)
class EmulatedConfig:
    """Operator choices for an emulated engine. Validated on construction."""

    model: str = "tiny"
    profile_path: str = ""  # "" = the shipped Llama-3.1-8B / A100-80GB profile
    block_size: int = 16
    kv_bytes_per_token: int = 16  # scaled-down bytes really stored and moved per token
    num_kv_blocks: int = 0  # 0 = the profile's capacity
    max_num_seqs: int = 256
    kv_zero_on_free: bool = False
    time_scale: float = 1.0  # < 1 runs faster than real time (benchmarks compress time)
    max_model_len: int = 0  # 0: the profile's context limit

    def __post_init__(self) -> None:
        if self.max_model_len < 0:
            raise ValueError("max_model_len must be >= 0")
        if self.block_size <= 0 or self.kv_bytes_per_token <= 0 or self.kv_bytes_per_token % 4:
            raise ValueError("block_size > 0 and kv_bytes_per_token a positive multiple of 4")
        if self.num_kv_blocks < 0 or self.max_num_seqs <= 0 or self.time_scale <= 0:
            raise ValueError("num_kv_blocks >= 0, max_num_seqs > 0, time_scale > 0")


def pseudo_token(seed: int, index: int, prev_token: int, vocab_size: int, skip: int) -> int:
    """Deterministic pseudo-random token id in ``[skip, vocab_size)``."""
    h = hashlib.blake2b(f"{seed}:{index}:{prev_token}".encode(), digest_size=8).digest()
    return skip + int.from_bytes(h, "little") % (vocab_size - skip)


class EmulatedEngine:
    kind = "emulated"

    def __init__(self, cfg: EmulatedConfig, profile: LatencyProfile, tokenizer: Tokenizer) -> None:
        self.cfg = cfg
        self.profile = profile
        self.tokenizer = tokenizer
        self.model_name = cfg.model
        self.max_model_len = min(
            cfg.max_model_len or profile.max_context_tokens, profile.max_context_tokens
        )
        num_blocks = cfg.num_kv_blocks or max(1, profile.kv_capacity_tokens // cfg.block_size)
        # One "layer" of one "head" whose width carries the scaled-down bytes per token.
        self.arena = KVArena(num_blocks, 1, 1, cfg.kv_bytes_per_token // 8, cfg.block_size)
        self.block_manager = BlockManager(
            num_blocks, cfg.block_size, self.arena.zero_blocks if cfg.kv_zero_on_free else None
        )
        self.eos_token_ids: tuple[int, ...] = tuple(tokenizer.eos_token_ids)
        specials = max((*self.eos_token_ids, tokenizer.bos_token_id or 0), default=0)
        self._skip = min(specials + 1, tokenizer.vocab_size - 1)
        self.weight_digest = hashlib.sha256(profile.to_json().encode()).hexdigest()[:16]

    @classmethod
    def load(cls, cfg: EmulatedConfig) -> EmulatedEngine:
        from shared.engine.profiles import load_profile
        from shared.tokenizer.models import load_tokenizer

        return cls(cfg, load_profile(cfg.profile_path), load_tokenizer(cfg.model))

    # ------------------------------------------------------------------ compute
    def predict_step_s(self, steps: Seq[StepInput]) -> float:
        """Predicted wall time of one iteration over ``steps`` (profile, eq. 2 / 13)."""
        p = self.profile
        decode = [s for s in steps if s.num_new_tokens == 1 and s.start_pos > 0]
        total = 0.0
        if decode:
            total += p.decode_iter_time_s(len(decode), sum(s.context_len for s in decode))
        for s in steps:
            if s.num_new_tokens == 1 and s.start_pos > 0:
                continue
            if s.start_pos == 0:
                total += p.prefill_time_s(s.num_new_tokens)
            else:
                total += p.suffix_time_s(s.num_new_tokens, s.start_pos)
        return total * self.cfg.time_scale

    def step_full(
        self,
        steps: Seq[StepInput],
        specs: Seq[SampleSpec | None],
        prompt_specs: Seq[PromptLogprobsSpec | None] | None = None,
    ) -> StepOutput:
        """``step`` with logprobs of the emulated model: its next token is a pure function
        of the context, a point mass, so a sampled token has logprob 0 and is its own top-1.
        Prompt tokens get -9999 (vLLM's clamp of -inf): it does not score text it did not
        pick. For benchmarks of the wire cost, not for values."""
        out = StepOutput.empty(len(steps))
        out.tokens = self.step(steps, specs)
        for i, spec in enumerate(specs):
            tok = out.tokens[i]
            if spec is not None and tok is not None and spec.params.logprobs is not None:
                top = (tok,) if spec.params.logprobs > 0 else ()
                out.logprobs[i] = Logprob(0.0, top, (0.0,) * len(top))
        for i, pspec in enumerate(prompt_specs or ()):
            if pspec is not None:
                out.prompt_logprobs[i] = [Logprob(-9999.0) for _ in pspec.targets]
        return out

    def step(self, steps: Seq[StepInput], specs: Seq[SampleSpec | None]) -> list[int | None]:
        """Sleep the predicted time, write deterministic KV bytes, return pseudo tokens."""
        for s in steps:
            if s.context_len > self.max_model_len:
                raise ContextLengthError(
                    f"{s.seq_id}: {s.context_len} tokens exceed the context limit "
                    f"{self.max_model_len}"
                )
        started = time.perf_counter()
        bs = self.cfg.block_size
        view = self.arena.tensor.view(self.arena.num_blocks, bs, -1)
        for s in steps:
            # One scatter per sequence (a Python loop per token held the GIL ~1 ms per
            # 128-token prompt and delayed the worker's event loop by as much).
            pos = torch.arange(s.start_pos, s.start_pos + len(s.token_ids), dtype=torch.int64)
            table = torch.tensor(s.block_table, dtype=torch.int64)
            values = torch.tensor(s.token_ids, dtype=torch.float64) * 1000003 + pos
            view[table[pos // bs], pos % bs] = values.to(view.dtype).unsqueeze(1)
        out: list[int | None] = []
        for s, spec in zip(steps, specs, strict=True):
            if spec is None:
                out.append(None)
                continue
            out.append(
                pseudo_token(
                    spec.seed, spec.step, s.token_ids[-1], self.tokenizer.vocab_size, self._skip
                )
            )
        remaining = self.predict_step_s(steps) - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
        return out

    def check_prompt(self, num_prompt_tokens: int, max_tokens: int = 1) -> None:
        if num_prompt_tokens <= 0:
            raise ContextLengthError("prompt is empty")
        if num_prompt_tokens + 1 > self.max_model_len:
            raise ContextLengthError(
                f"prompt has {num_prompt_tokens} tokens; the context limit is {self.max_model_len}"
            )

    def reslice(self, role: str) -> int:
        """Same contract as ``Engine.reslice``; the emulated engine computes no activations,
        so nothing is lent and the KV pool keeps its size. Returns 0."""
        return 0

    # ------------------------------------------------------------- descriptors
    def fingerprint_fields(self) -> dict[str, Any]:
        return {
            "model_digest": f"emulated:{self.profile.model}",
            "weight_digest": self.weight_digest,
            "dtype": "float32",
            "block_size": self.cfg.block_size,
            "kv_layout": self.arena.layout,
            "tp_rank": 0,
            "tp_size": 1,
            "rope": "emulated",
            "tokenizer_digest": self.tokenizer.digest(),
        }

    def describe(self) -> dict[str, Any]:
        return {
            "engine": self.kind,
            "model": self.model_name,
            "profile": f"{self.profile.model} on {self.profile.hardware}",
            "num_kv_blocks": self.arena.num_blocks,
            "block_size": self.cfg.block_size,
            "kv_block_bytes": self.arena.block_nbytes,
            "max_model_len": self.max_model_len,
            "threads": torch.get_num_threads(),
        }
