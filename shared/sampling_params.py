"""Per-request sampling parameters. No torch: the router builds and validates these."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.errors import InvalidRequestError

MAX_LOGPROBS = 20  # top logprobs per position (OpenAI's bound, vLLM's default max_logprobs)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. Validated on construction.

    ``temperature == 0`` means greedy. ``seed`` makes sampling deterministic: token number
    ``step`` of a request is drawn from a generator seeded with ``(seed, step)``, so the same
    request gives the same tokens whatever it is batched with, and a request that moves to
    another worker (FluidToken split, live migration) needs only ``seed`` and its step count.
    ``stop`` strings are applied to the detokenized text by whoever detokenizes (router,
    ``fluidpd generate``); the engine applies ``stop_token_ids`` and EOS.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    # Logprobs (shared/engine/logprobs.py): None = not asked; k >= 0 = the sampled token's
    # logprob plus the k most likely (``prompt_logprobs``: the same for each prompt token).
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidRequestError("max_tokens must be an integer")
        if self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be > 0, got {self.max_tokens}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be >= -1, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError("seed must be in [0, 2**63)")
        if len(self.stop) > 16 or any(not s or len(s) > 256 for s in self.stop):
            raise InvalidRequestError("stop: at most 16 non-empty strings of at most 256 chars")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequestError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
