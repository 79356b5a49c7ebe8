"""What this worker tells the registry about itself (``WorkerRecord``): identity, role and
state, where its KV transfer node listens, its model, pool and limits."""

from __future__ import annotations

import os
import time

from services.worker.config import WorkerConfig
from services.worker.engine_factory import fingerprint_of
from services.worker.status import WorkerStatus
from shared.engine.interface import StepEngine
from shared.messages import WorkerRecord


def worker_record(
    cfg: WorkerConfig,
    status: WorkerStatus,
    engine: StepEngine,
    ucx_address: bytes,
    started_at_s: float,
) -> WorkerRecord:
    """The record now (heartbeat time: now)."""
    bm = engine.block_manager
    return WorkerRecord(
        worker_id=cfg.worker_id,
        role=status.role,
        state=status.state,
        pid=os.getpid(),
        host=cfg.host,
        ucx_address=ucx_address,
        model=cfg.model,
        fingerprint=fingerprint_of(engine).digest()[:32],
        kv_total_blocks=bm.num_blocks,
        kv_block_size=bm.block_size,
        max_model_len=engine.max_model_len,
        started_at_s=started_at_s,
        heartbeat_at_s=time.time(),
        heartbeat_period_s=cfg.heartbeat_s,
        engine=engine.kind,
        decode_reserve_tokens=cfg.decode_reserve_tokens,
        max_num_seqs=cfg.max_num_seqs,
    )
