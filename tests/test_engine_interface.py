"""Both engines satisfy the ``StepEngine`` Protocol (shared/engine/interface.py).

The static half is in interface.py itself (``_both_engines_satisfy``, checked by ``mypy
shared services``); this is the run-time half, on the real tiny torch engine and the
emulated engine, plus the worker's engine factory.
"""

from __future__ import annotations

import subprocess
import sys

from services.worker.config import WorkerConfig
from services.worker.engine_factory import build_engine, fingerprint_of
from shared.engine.block_manager import BlockManager
from shared.engine.config import EngineConfig
from shared.engine.emulated import EmulatedConfig, EmulatedEngine
from shared.engine.engine import Engine
from shared.engine.interface import StepEngine


def _check(engine: StepEngine) -> None:
    assert isinstance(engine, StepEngine)
    assert isinstance(engine.block_manager, BlockManager)
    assert engine.max_model_len > 0
    assert engine.describe()["engine"] == engine.kind
    engine.block_manager.check_integrity()


def test_torch_engine_satisfies_protocol() -> None:
    _check(Engine.load(EngineConfig(model="tiny", block_size=4, num_kv_blocks=16)))


def test_emulated_engine_satisfies_protocol() -> None:
    _check(EmulatedEngine.load(EmulatedConfig(model="tiny", num_kv_blocks=16)))


def test_worker_factory_builds_a_step_engine() -> None:
    cfg = WorkerConfig(
        worker_id="w1", role="decode", engine="emulated", num_kv_blocks=16, cluster_secret="s"
    )
    engine = build_engine(cfg)
    _check(engine)
    assert fingerprint_of(engine).block_size == cfg.block_size


def test_an_object_missing_members_is_not_a_step_engine() -> None:
    class Partial:
        kind = "partial"
        max_model_len = 8

        def step(self, steps: object, specs: object) -> list[int | None]:
            return []

    assert not isinstance(Partial(), StepEngine)


def test_interface_does_not_import_torch() -> None:
    # Routers and tools may annotate with StepEngine without paying for torch.
    code = "import sys, shared.engine.interface; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
