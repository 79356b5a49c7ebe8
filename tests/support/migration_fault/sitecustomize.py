"""Live-migration send fault injection for real worker processes (tests only).

Put this folder first on PYTHONPATH and set ``FLUIDPD_TEST_MIGRATION_FAULT_DIR``: from then
on, a worker process whose id names a file in that folder fails every live-migration KV
send (``KVSender.send`` with the ``migrated_cached_tokens`` meta) to the peers the file
lists (whitespace separated; ``*``: every peer). The send fails the way a retryable
transport fault does: the envelope is on the wire, the first segment raises a retryable
``TransferError``, and the real sender sends its abort, so the peer's receive fails too
(``TransferAborted``) and the migration goes on to its next peer or resumes. The test
writes or removes the file when it wants the fault. Prefill hand-offs and any other
process (router, controller, CLI) are left alone.
"""

from __future__ import annotations

import os
from typing import Any


def _install() -> None:
    fault_dir = os.environ.get("FLUIDPD_TEST_MIGRATION_FAULT_DIR")
    if not fault_dir:
        return
    try:
        with open("/proc/self/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return
    if not any(a.startswith(b"services.") and a.endswith(b"_worker") for a in argv):
        return
    from shared.transfer import sender as sender_module
    from shared.transfer.errors import TransferError

    original = sender_module.KVSender.send

    def failing_peers(worker_id: str) -> set[str]:
        try:
            with open(os.path.join(fault_dir, worker_id)) as f:
                return set(f.read().split())
        except OSError:
            return set()

    async def send(self: Any, ticket: Any, *args: Any, **kwargs: Any) -> Any:
        peers = failing_peers(self.worker_id)
        meta = kwargs.get("meta") or {}
        if "migrated_cached_tokens" in meta and ({"*", ticket.dst_worker_id} & peers):

            async def segment_ready(first: int, count: int) -> None:
                raise TransferError(
                    "migration send failed (fault injected by the test)",
                    request_id=ticket.request_id,
                    retryable=True,
                )

            kwargs["segment_ready"] = segment_ready
        return await original(self, ticket, *args, **kwargs)

    sender_module.KVSender.send = send  # type: ignore[method-assign]


_install()
