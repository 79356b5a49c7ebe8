"""KV-cache transfer between workers over UCX (ucxx): envelope, sender, receiver.

See docs/transfer.md for the protocol, ownership rules and measured figures.
"""

from shared.transfer.envelope import Envelope, KVFingerprint, TransferTicket, block_checksums
from shared.transfer.errors import (
    TransferAborted,
    TransferError,
    TransferRejected,
    TransferTimeout,
    TransportError,
)
from shared.transfer.receiver import KVReceiver, ReceivedKV
from shared.transfer.sender import KVSender, SendOutcome
from shared.transfer.ucx_node import TransferNode, TransferNodeConfig

__all__ = [
    "Envelope",
    "KVFingerprint",
    "KVReceiver",
    "KVSender",
    "ReceivedKV",
    "SendOutcome",
    "TransferAborted",
    "TransferError",
    "TransferNode",
    "TransferNodeConfig",
    "TransferRejected",
    "TransferTicket",
    "TransferTimeout",
    "TransportError",
    "block_checksums",
]
