"""What a worker needs from an engine: the ``StepEngine`` Protocol.

Both ``Engine`` (torch, shared/engine/engine.py) and ``EmulatedEngine``
(shared/engine/emulated.py) satisfy it structurally; neither inherits from it. Workers,
benchmarks and tests annotate with ``StepEngine`` instead of ``Any`` so mypy checks every
use against both engines. tests/test_engine_interface.py asserts both satisfy it, under
mypy (typed assignments) and at run time (``isinstance``, presence of members only).

Both engines own one ``BlockManager`` (shared/engine/block_manager.py, the same class), so
there is no separate block-manager Protocol: annotate with ``BlockManager``.

Members are read-only properties here so that plain instance or class attributes satisfy
them and callers cannot assign through the Protocol. Importing this module does not import
torch (the step types are only named for the type checker).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from shared.engine.batch import StepInput
    from shared.engine.block_manager import BlockManager
    from shared.engine.engine import SampleSpec
    from shared.engine.kv_arena import KVArena
    from shared.engine.logprobs import PromptLogprobsSpec, StepOutput
    from shared.tokenizer import Tokenizer


@runtime_checkable
class StepEngine(Protocol):
    """A loaded model (or its emulation) with its KV arena and block manager.

    Threading: ``step``/``step_full``/``reslice`` run on the worker's one engine thread; the
    event loop owns ``block_manager`` (only it allocates and frees blocks).
    """

    @property
    def kind(self) -> str:
        """``"torch"`` or ``"emulated"``."""
        ...

    @property
    def model_name(self) -> str: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def arena(self) -> KVArena:
        """The KV bytes, block-major; transfers read and write it by block id."""
        ...

    @property
    def block_manager(self) -> BlockManager:
        """The one owner of free lists, reservations and block tables of ``arena``."""
        ...

    @property
    def max_model_len(self) -> int:
        """The context limit in tokens (prompt + output)."""
        ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    def step(
        self, steps: Sequence[StepInput], specs: Sequence[SampleSpec | None]
    ) -> list[int | None]:
        """Run one iteration: write the steps' KV, sample a token where ``specs[i]`` is not
        None (else None). Raises ContextLengthError past the context limit."""
        ...

    def step_full(
        self,
        steps: Sequence[StepInput],
        specs: Sequence[SampleSpec | None],
        prompt_specs: Sequence[PromptLogprobsSpec | None] | None = None,
    ) -> StepOutput:
        """``step`` plus the logprobs the specs ask for."""
        ...

    def check_prompt(self, num_prompt_tokens: int, max_tokens: int = 1) -> None:
        """Raise ContextLengthError if the prompt cannot be served at all."""
        ...

    def reslice(self, role: str) -> int:
        """Re-slice the arena for ``role``; returns the blocks lent afterwards. Mutates the
        block manager: call only while no step runs. Raises BlockStateError if it cannot."""
        ...

    def fingerprint_fields(self) -> dict[str, Any]:
        """Everything that must match for KV computed here to be valid on a peer."""
        ...

    def describe(self) -> dict[str, Any]:
        """Identifiers and sizes for the start-up log line (no weights, no prompt text)."""
        ...


if TYPE_CHECKING:
    from shared.engine.emulated import EmulatedEngine
    from shared.engine.engine import Engine

    def _both_engines_satisfy(torch_engine: Engine, emulated: EmulatedEngine) -> list[StepEngine]:
        """Never called: ``mypy shared`` (make lint) fails here if either engine stops
        satisfying ``StepEngine``."""
        return [torch_engine, emulated]
