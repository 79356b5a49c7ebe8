"""The torch engine: weights + KV arena + block manager + forward + sampling.

``Engine`` is compute and storage. It does not schedule: callers (``fluidpd generate``'s
loop in generate.py, the worker runtime) decide what runs in each step, grow block tables
through ``engine.block_manager`` and call ``forward`` / ``sample``.

Threading: ``forward`` may run in a worker thread while the event loop thread owns the
block manager; it only writes KV bytes of blocks named in its inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from shared.engine.attention import TorchPagedAttention, make_attention
from shared.engine.batch import StepInput, build_batch
from shared.engine.block_manager import BlockManager
from shared.engine.config import EngineConfig, ModelConfig
from shared.engine.kv_arena import KVArena
from shared.engine.logprobs import PromptLogprobsSpec, StepOutput, score_rows
from shared.engine.memory import kv_budget_bytes
from shared.engine.model import LlamaModel
from shared.engine.sampler import sample
from shared.errors import ContextLengthError, ModelLoadError
from shared.policy.roles import DECODE
from shared.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shared.engine.loader import LoadedModel
    from shared.tokenizer import Tokenizer


@dataclass(frozen=True)
class SampleSpec:
    """Sample the next token of a request: its params, token index and resolved seed."""

    params: SamplingParams
    step: int
    seed: int


class Engine:
    """A loaded model with its KV cache. Construct with ``Engine.load(cfg)``."""

    kind = "torch"

    def __init__(self, cfg: EngineConfig, loaded: LoadedModel) -> None:
        self.cfg = cfg
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.device = torch.device(cfg.device)
        self.model_config: ModelConfig = loaded.config
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.model_name = cfg.model
        self.weight_digest = loaded.weight_digest
        self.model_source = loaded.source
        mc = self.model_config
        self.max_model_len = min(
            cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        attention = make_attention(cfg.attention_backend, self.device, 1.0 / math.sqrt(mc.head_dim))
        # ``extra=(("linear_kernel", "mm"),)`` forces the plain-torch projections (linear.py).
        self.model = LlamaModel(
            mc,
            loaded.weights,
            attention,
            cfg.torch_dtype,
            self.device,
            self.max_model_len,
            linear_kernel=str(dict(cfg.extra).get("linear_kernel", "auto")),
        )
        block_bytes = cfg.block_size * mc.kv_bytes_per_token(cfg.torch_dtype)
        kv_bytes = cfg.kv_cache_bytes
        if cfg.gpu_memory_utilization > 0 and not cfg.num_kv_blocks:
            kv_bytes = kv_budget_bytes(self.device, cfg.gpu_memory_utilization)
        num_blocks = cfg.num_kv_blocks or max(1, kv_bytes // block_bytes)
        self.arena = KVArena(
            num_blocks,
            mc.num_layers,
            mc.num_kv_heads,
            mc.head_dim,
            cfg.block_size,
            cfg.torch_dtype,
            self.device,
        )
        self._kv_layers = [self.arena.layer_view(i) for i in range(mc.num_layers)]
        self.block_manager = BlockManager(
            num_blocks, cfg.block_size, self.arena.zero_blocks if cfg.kv_zero_on_free else None
        )
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys((*mc.eos_token_ids, *self.tokenizer.eos_token_ids))
        )

    @classmethod
    def load(cls, cfg: EngineConfig) -> Engine:
        """Load ``cfg.model`` through the one loader. Raises ModelLoadError on bad files or
        a CUDA device this host does not have."""
        from shared.engine.loader import load_model

        if cfg.device.startswith("cuda"):
            index = int(cfg.device.partition(":")[2] or 0)
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if index >= count:
                raise ModelLoadError(
                    f"device {cfg.device}: no such CUDA device ({count} visible to this process)"
                )

        return cls(cfg, load_model(cfg.model, cfg.torch_dtype))

    # ------------------------------------------------------------------ compute
    def forward(self, steps: Seq[StepInput]) -> torch.Tensor:
        """Compute logits ``[len(steps), vocab]`` for the last new token of each step.

        Writes the new tokens' KV into the blocks named by each step's block table.
        Raises ContextLengthError if a step runs past the context limit.
        """
        self._check_context(steps)
        batch = build_batch(steps, self.cfg.block_size, self.device)
        return self.model.forward(batch, self._kv_layers)

    def sample(
        self,
        logits: torch.Tensor,
        params: Seq[SamplingParams],
        steps: Seq[int],
        seeds: Seq[int],
    ) -> list[int]:
        return sample(logits, params, steps, seeds)

    def step(self, steps: Seq[StepInput], specs: Seq[SampleSpec | None]) -> list[int | None]:
        """Forward ``steps`` and sample a token for each step whose spec is not None.

        This is the one call schedulers make (torch and emulated engines alike).
        """
        return self.step_full(steps, specs).tokens

    def step_full(
        self,
        steps: Seq[StepInput],
        specs: Seq[SampleSpec | None],
        prompt_specs: Seq[PromptLogprobsSpec | None] | None = None,
    ) -> StepOutput:
        """``step`` plus logprobs: of each sampled token whose params ask for them, and of
        the prompt tokens named by ``prompt_specs[i]`` (rows of step i, see
        PromptLogprobsSpec). Raises ValueError if a prompt spec has more targets than its
        step has new tokens."""
        prompt_specs = prompt_specs or [None] * len(steps)
        # Logit rows: every scored prompt row of a step, then its last (sampling) row.
        rows_of: list[tuple[int, int]] = []  # per step: (first prompt row, sampling row)
        wanted: list[int] = []
        q = 0
        for step, pspec in zip(steps, prompt_specs, strict=True):
            n_prompt = len(pspec.targets) if pspec is not None else 0
            if n_prompt > step.num_new_tokens:
                raise ValueError(f"{step.seq_id}: more prompt targets than new tokens")
            first = len(wanted)
            wanted.extend(range(q, q + min(n_prompt, step.num_new_tokens - 1)))
            rows_of.append((first, len(wanted)))
            wanted.append(q + step.num_new_tokens - 1)
            q += step.num_new_tokens
        logits = self._forward_rows(steps, wanted if len(wanted) != len(steps) else None)
        out = StepOutput.empty(len(steps))
        for i, (step, pspec) in enumerate(zip(steps, prompt_specs, strict=True)):
            first, last = rows_of[i]
            if pspec is not None:
                # The sampling row scores a target too when the chunk ends mid-prompt.
                end = last + 1 if len(pspec.targets) == step.num_new_tokens else last
                out.prompt_logprobs[i] = score_rows(logits[first:end], pspec.targets, pspec.num_top)
        sample_rows = [rows_of[i][1] for i, spec in enumerate(specs) if spec is not None]
        if sample_rows:
            chosen = [s for s in specs if s is not None]
            sample_logits = logits[sample_rows]
            toks = sample(
                sample_logits,
                [c.params for c in chosen],
                [c.step for c in chosen],
                [c.seed for c in chosen],
            )
            k = 0
            for i, spec in enumerate(specs):
                if spec is None:
                    continue
                out.tokens[i] = toks[k]
                if spec.params.logprobs is not None:
                    out.logprobs[i] = score_rows(
                        sample_logits[k : k + 1], [toks[k]], spec.params.logprobs
                    )[0]
                k += 1
        return out

    def _check_context(self, steps: Seq[StepInput]) -> None:
        """Raises ContextLengthError for the first step past the context limit."""
        for s in steps:
            if s.context_len > self.max_model_len:
                raise ContextLengthError(
                    f"{s.seq_id}: {s.context_len} tokens exceed the context limit "
                    f"{self.max_model_len}"
                )

    def _forward_rows(self, steps: Seq[StepInput], rows: list[int] | None) -> torch.Tensor:
        """``forward``, but logits for the flattened token ``rows`` (None: last of each)."""
        if rows is None:
            return self.forward(steps)
        self._check_context(steps)
        batch = build_batch(steps, self.cfg.block_size, self.device)
        batch = replace(
            batch, logits_indices=torch.tensor(rows, dtype=torch.long, device=self.device)
        )
        return self.model.forward(batch, self._kv_layers)

    # ---------------------------------------------------------------- re-slice
    def reslice(self, role: str) -> int:
        """Re-slice the arena for ``role`` (a FluidRole switch, and at start): ``prefill``
        lends the arena's tail blocks to the attention backend as the workspace prompt
        chunks gather their context into (at most 1/8 of the pool; contexts beyond it
        gather into fresh memory); ``decode`` returns them to the KV pool. Nothing is
        freed to the OS or reloaded. Returns the number of blocks lent afterwards.

        Mutates the block manager and the backend: call only while no forward runs.
        Raises BlockStateError (nothing changed) if the tail blocks are in use.
        """
        bm, attn = self.block_manager, self.model.attention
        if not isinstance(attn, TorchPagedAttention):
            return 0  # FlashInfer keeps its own workspace buffers
        if role == DECODE:
            attn.workspace = None
            bm.reclaim_lent()
            return 0
        if bm.lent_blocks:
            return len(bm.lent_blocks)
        kv_layer = self._kv_layers[0]
        elt = kv_layer.element_size()
        want = attn.workspace_nbytes(self.max_model_len, kv_layer.shape, elt)
        num_blocks = min(-(-want // self.arena.block_nbytes), bm.num_blocks // 8)
        if num_blocks <= 0:
            return 0
        lent = bm.lend_tail(num_blocks)
        _, _, bs, hkv, d = kv_layer.shape
        max_blocks = (num_blocks * self.arena.block_nbytes) // (2 * bs * hkv * d * elt)
        raw = self.arena.run_bytes(lent.start, len(lent)).view(kv_layer.dtype)
        attn.workspace = raw[: 2 * max_blocks * bs * hkv * d].view(2, max_blocks, bs, hkv, d)
        return num_blocks

    def check_prompt(self, num_prompt_tokens: int, max_tokens: int = 1) -> None:
        """Raise ContextLengthError if the prompt cannot be served at all."""
        if num_prompt_tokens <= 0:
            raise ContextLengthError("prompt is empty")
        if num_prompt_tokens + 1 > self.max_model_len:
            raise ContextLengthError(
                f"prompt has {num_prompt_tokens} tokens; the context limit is "
                f"{self.max_model_len} (including at least one generated token)"
            )

    # ------------------------------------------------------------- descriptors
    def fingerprint_fields(self) -> dict[str, Any]:
        """Everything that must match for KV computed here to be valid on a peer."""
        mc = self.model_config
        return {
            "model_digest": mc.digest(),
            "weight_digest": self.weight_digest,
            "dtype": self.cfg.dtype,
            "block_size": self.cfg.block_size,
            "kv_layout": self.arena.layout,
            "tp_rank": 0,
            "tp_size": 1,
            "rope": f"{mc.rope_theta}:{dict(mc.rope_scaling)}",
            "tokenizer_digest": self.tokenizer.digest(),
        }

    def describe(self) -> dict[str, Any]:
        return {
            "engine": self.kind,
            "model": self.model_name,
            "architecture": self.model_config.architecture,
            "num_kv_blocks": self.arena.num_blocks,
            "block_size": self.cfg.block_size,
            "kv_block_bytes": self.arena.block_nbytes,
            "max_model_len": self.max_model_len,
            "attention": self.model.attention.name,
            "linear_kernel": self.model.linear_kernel,
            "threads": torch.get_num_threads(),
        }
