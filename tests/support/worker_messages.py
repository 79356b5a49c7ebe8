"""A worker's registry record and telemetry message with plain fixed values, for the tests
that need them without a worker process: pure bookkeeping (controller book, pairing,
overload choices, switch leases), codec samples, and fake workers on a real bus. Each test
overrides only the fields it is about."""

from __future__ import annotations

import dataclasses
from typing import Any

from shared.messages import Role, WorkerRecord, WorkerTelemetry


def worker_record(worker_id: str, role: Role, **fields: Any) -> WorkerRecord:
    """An ``active`` worker's record: 128 KV blocks of 16 tokens, max_model_len 4096, every
    other field WorkerRecord's default; ``fields`` replace any of them. Raises what
    WorkerRecord's checks raise."""
    record = WorkerRecord(
        worker_id=worker_id,
        role=role,
        state="active",
        pid=1,
        host="h",
        model="m",
        fingerprint="f",
        kv_total_blocks=128,
        kv_block_size=16,
        max_model_len=4096,
        started_at_s=0.0,
        heartbeat_at_s=0.0,
        heartbeat_period_s=1.0,
    )
    return dataclasses.replace(record, **fields)


def worker_telemetry(worker_id: str, role: Role, **fields: Any) -> WorkerTelemetry:
    """An idle ``active`` worker's first telemetry (epoch 1, seq 0): nothing queued or
    running, all 128 blocks free, every pressure 0, no metrics; ``fields`` replace any."""
    telemetry = WorkerTelemetry(
        publisher_id=worker_id,
        epoch=1,
        seq=0,
        time_s=0.0,
        role=role,
        state="active",
        queue_len=0,
        running=0,
        free_blocks=128,
        total_blocks=128,
        ppi=0.0,
        dpi_load=0.0,
        dpi_adm=0.0,
    )
    return dataclasses.replace(telemetry, **fields)
