"""Build the worker's engine (torch or emulated) from its config; derive the KV fingerprint."""

from __future__ import annotations

from services.worker.config import WorkerConfig
from shared.engine.interface import StepEngine
from shared.transfer.envelope import KVFingerprint


def build_engine(cfg: WorkerConfig) -> StepEngine:
    """Load the engine named by ``cfg.engine``. Raises ModelLoadError on bad model files."""
    if cfg.engine == "emulated":
        from shared.engine.emulated import EmulatedConfig, EmulatedEngine

        return EmulatedEngine.load(
            EmulatedConfig(
                model=cfg.model,
                profile_path=cfg.profile,
                block_size=cfg.block_size,
                kv_bytes_per_token=cfg.emulated_kv_bytes_per_token,
                num_kv_blocks=cfg.num_kv_blocks,
                max_num_seqs=cfg.max_num_seqs,
                kv_zero_on_free=cfg.kv_zero_on_free,
                time_scale=cfg.time_scale,
                max_model_len=cfg.max_model_len,
            )
        )
    from shared.engine.config import EngineConfig
    from shared.engine.engine import Engine

    return Engine.load(
        EngineConfig(
            model=cfg.model,
            block_size=cfg.block_size,
            num_kv_blocks=cfg.num_kv_blocks,
            kv_cache_bytes=cfg.kv_cache_bytes,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            max_model_len=cfg.max_model_len,
            device=cfg.device,
            dtype=cfg.dtype,
            max_num_seqs=cfg.max_num_seqs,
            num_threads=cfg.num_threads,
            kv_zero_on_free=cfg.kv_zero_on_free,
        )
    )


def fingerprint_of(engine: StepEngine) -> KVFingerprint:
    f = engine.fingerprint_fields()
    return KVFingerprint(
        arch_digest=f["model_digest"],
        weight_digest=f["weight_digest"],
        dtype=f["dtype"],
        block_size=f["block_size"],
        kv_layout=f["kv_layout"],
        tp_rank=f["tp_rank"],
        tp_size=f["tp_size"],
        rope_params=f["rope"],
        tokenizer_digest=f["tokenizer_digest"],
    )
