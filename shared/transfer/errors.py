"""Typed errors of the KV transfer layer.

Every error says whether the *request* may be retried with a fresh ticket (``retryable``):
true only while KV ownership certainly has not moved to the receiving side. After the
receiver may have installed the blocks (the sender sent its last message but no verdict
came back) a retry could duplicate the request, so ``retryable`` is False.
"""

from __future__ import annotations

from shared.errors import FluidPDError


class TransferError(FluidPDError):
    """Base class: a KV transfer did not complete. ``reason`` is a short machine-ish string."""

    code = "kv_transfer_error"
    http_status = 503

    def __init__(self, reason: str, *, request_id: str = "", retryable: bool = False) -> None:
        super().__init__(f"{reason} (request {request_id!r})" if request_id else reason)
        self.reason = reason
        self.request_id = request_id
        self.retryable = retryable


class TransferRejected(TransferError):
    """Validation failed: signature, fingerprint, token range, generation ids, checksums.

    Raised on the receiver when it rejects, and on the sender when the receiver's verdict
    is a rejection. Nothing was installed.
    """

    code = "kv_transfer_rejected"


class TransferTimeout(TransferError):
    """The transfer's deadline passed before it completed (slow or dead peer)."""

    code = "kv_transfer_timeout"


class TransferAborted(TransferError):
    """The peer cancelled the transfer (sender abort message or receiver rejection)."""

    code = "kv_transfer_aborted"


class TransportError(TransferError):
    """UCX reported an error (endpoint failure, truncated message, ...)."""

    code = "kv_transport_error"
