"""This worker's KV transfer endpoints: one UCX node, a sender (prefill exports, migrations
out) and a receiver (decode admissions, migrations in), all sealed with the cluster secret
and the engine's fingerprint (docs/architecture.md, "KV hand-off")."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from services.worker.config import WorkerConfig
from services.worker.engine_factory import fingerprint_of
from shared.engine.interface import StepEngine
from shared.transfer.receiver import KVReceiver
from shared.transfer.sender import KVSender
from shared.transfer.ucx_node import TransferNode, TransferNodeConfig


@dataclass(frozen=True)
class TransferEndpoints:
    node: TransferNode
    sender: KVSender
    receiver: KVReceiver


async def open_transfer(
    cfg: WorkerConfig, engine: StepEngine, stack: contextlib.AsyncExitStack
) -> TransferEndpoints:
    """Start the node and make both endpoints; their closing is pushed onto ``stack``
    (endpoints first, then the node). Raises what ``TransferNode.start`` raises."""
    node = TransferNode(
        TransferNodeConfig(cuda_device=cfg.device if cfg.device.startswith("cuda") else None)
    )
    await node.start()
    stack.push_async_callback(node.close)
    fingerprint = fingerprint_of(engine)
    secret = cfg.secret_bytes  # never empty (WorkerConfig checks)
    sender = KVSender(node, worker_id=cfg.worker_id, fingerprint=fingerprint, secret=secret)
    receiver = KVReceiver(
        node,
        worker_id=cfg.worker_id,
        block_manager=engine.block_manager,
        arena=engine.arena,
        fingerprint=fingerprint,
        secret=secret,
    )
    stack.callback(sender.close)
    stack.callback(receiver.close)
    return TransferEndpoints(node, sender, receiver)
