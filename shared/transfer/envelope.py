"""What travels with KV bytes: fingerprint, ticket, envelope, checksum trailer, verdict.

Every control message is *sealed*: ``msgpack([kind, body, hmac_sha256(secret, kind|body)])``
where ``body`` is the msgpack encoding of the fields. The MAC is computed over the exact
bytes sent, so no canonical encoding is needed, and ``kind`` is inside the MAC so a message
of one kind cannot be replayed as another. A peer without the cluster secret cannot forge
a ticket, an envelope, a trailer or a verdict, hence cannot get a block installed.

Checksums are per block, of the algorithm the envelope names (``checksum_algorithm``:
xxh3_64 from a CPU arena, fold64 from a CUDA one; shared/transfer/checksum.py). They travel
in a separate trailer (sealed and bound to the envelope's MAC) so the sender can hash block
runs while earlier runs are already on the wire.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any

import msgpack
import numpy as np

from shared.transfer.checksum import XXH3, block_checksums
from shared.transfer.errors import TransferRejected

__all__ = [  # block_checksums is re-exported: callers hash with the envelope's names
    "Envelope",
    "KVFingerprint",
    "TransferTicket",
    "block_checksums",
    "decode_abort",
    "decode_trailer",
    "decode_verdict",
    "encode_abort",
    "encode_trailer",
    "encode_verdict",
    "seal",
    "unseal",
]

PROTOCOL_VERSION = 1
META_MAX_BYTES = 4096
_FRAME_HEADER = struct.Struct("<I")  # payload length: a receive buffer is larger than a frame


@dataclass(frozen=True)
class KVFingerprint:
    """Everything that must agree for KV bytes to mean the same thing on both sides.

    Callers fill it from their model and engine config; ``digest()`` goes into envelopes.
    """

    arch_digest: str
    weight_digest: str
    dtype: str
    block_size: int
    kv_layout: str
    tp_rank: int = 0
    tp_size: int = 1
    rope_params: str = ""
    tokenizer_digest: str = ""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be > 0")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")

    def digest(self) -> str:
        """Stable hex digest (sha256 of the sorted-key JSON of every field)."""
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


def _shallow_fields(obj: Any) -> dict[str, Any]:
    """The dataclass's fields as a dict, without ``asdict``'s deep copy (which costs ~1 ms
    per 1000 block ids; msgpack packs tuples as they are)."""
    return {f.name: getattr(obj, f.name) for f in dataclass_fields(obj)}


# ------------------------------------------------------------------------ sealing
def _mac(secret: bytes, kind: str, body: bytes) -> bytes:
    return hmac.new(secret, kind.encode() + b"|" + body, hashlib.sha256).digest()


def seal(kind: str, fields: Mapping[str, Any], secret: bytes) -> tuple[bytes, bytes]:
    """Return ``(frame, mac)``: a length-prefixed sealed message and its MAC."""
    body = msgpack.packb(dict(fields), use_bin_type=True)
    mac = _mac(secret, kind, body)
    payload = msgpack.packb([kind, body, mac], use_bin_type=True)
    return _FRAME_HEADER.pack(len(payload)) + payload, mac


def unseal(kind: str, frame: bytes | bytearray, secret: bytes) -> tuple[dict[str, Any], bytes]:
    """Check and open a frame made by ``seal``. Returns ``(fields, mac)``.

    Raises TransferRejected on a malformed frame, a wrong kind or a bad MAC.
    """
    try:
        (length,) = _FRAME_HEADER.unpack_from(frame, 0)
        if length > len(frame) - _FRAME_HEADER.size:
            raise ValueError("frame shorter than its length prefix")
        got_kind, body, mac = msgpack.unpackb(
            bytes(frame[_FRAME_HEADER.size : _FRAME_HEADER.size + length]), raw=False
        )
    except Exception:
        raise TransferRejected(f"malformed {kind} message") from None
    if got_kind != kind:
        raise TransferRejected(f"expected {kind} message, got {got_kind!r}")
    if not hmac.compare_digest(mac, _mac(secret, kind, body)):
        raise TransferRejected(f"{kind} signature invalid")
    return msgpack.unpackb(body, raw=False), mac


# ------------------------------------------------------------------------ messages
@dataclass(frozen=True)
class TransferTicket:
    """Receiver -> sender: where to write. Sealed by the receiver; the sender checks it.

    ``block_ids``/``generations`` are the receiver's reservation (may hold more blocks than
    the token range needs: room to decode into). ``transfer_id`` is chosen by the receiver,
    unique among its live transfers, low 20 bits zero; every tag of the transfer derives
    from it, which is how concurrent transfers from many peers are told apart.
    """

    transfer_id: int
    request_id: str
    dst_worker_id: str
    dst_address: bytes
    dst_host_id: str
    block_ids: tuple[int, ...]
    generations: tuple[int, ...]
    token_start: int
    token_end: int
    block_size: int
    block_nbytes: int

    @property
    def num_blocks(self) -> int:
        """Blocks the token range fills (a prefix of ``block_ids``)."""
        return -(-self.token_end // self.block_size) - self.token_start // self.block_size

    def encode(self, secret: bytes) -> bytes:
        frame, _ = seal("ticket", _shallow_fields(self), secret)
        return frame

    @classmethod
    def decode(cls, data: bytes, secret: bytes) -> TransferTicket:
        fields, _ = unseal("ticket", data, secret)
        fields["block_ids"] = tuple(fields["block_ids"])
        fields["generations"] = tuple(fields["generations"])
        return cls(**fields)


@dataclass(frozen=True)
class Envelope:
    """Sender -> receiver, first message of a transfer: what follows and whose it is.

    ``generations`` echoes the destination generation ids of the blocks written (a stale
    ticket is detected); ``segments`` lists ``(first logical block, num blocks)`` of every
    data message in order; ``meta`` is the caller's small dict (first token, sampling...).
    """

    transfer_id: int
    request_id: str
    fingerprint_digest: str
    token_start: int
    token_end: int
    num_blocks: int
    block_nbytes: int
    generations: tuple[int, ...]
    segments: tuple[tuple[int, int], ...]
    src_worker_id: str
    dst_worker_id: str
    src_address: bytes
    src_host_id: str
    has_checksums: bool
    meta: Mapping[str, Any] = field(default_factory=dict)
    checksum_algorithm: str = XXH3  # how the trailer's sums were made (checksum.ALGORITHMS)
    version: int = PROTOCOL_VERSION

    def encode(self, secret: bytes) -> tuple[bytes, bytes]:
        body = _shallow_fields(self)
        body["meta"] = dict(self.meta)
        if len(msgpack.packb(body["meta"], use_bin_type=True)) > META_MAX_BYTES:
            raise ValueError(f"meta larger than {META_MAX_BYTES} bytes")
        return seal("envelope", body, secret)

    @classmethod
    def decode(cls, data: bytes | bytearray, secret: bytes) -> tuple[Envelope, bytes]:
        fields, mac = unseal("envelope", data, secret)
        try:
            fields["generations"] = tuple(fields["generations"])
            fields["segments"] = tuple((int(a), int(b)) for a, b in fields["segments"])
            return cls(**fields), mac
        except Exception:
            raise TransferRejected("envelope fields malformed") from None


def encode_trailer(
    transfer_id: int, envelope_mac: bytes, checksums: Sequence[int], secret: bytes
) -> bytes:
    """Last sender message: per-block checksums, bound to the envelope by its MAC."""
    packed = np.asarray(checksums, dtype="<u8").tobytes()
    frame, _ = seal(
        "trailer", {"transfer_id": transfer_id, "env": envelope_mac, "sums": packed}, secret
    )
    return frame


def decode_trailer(
    data: bytes | bytearray, transfer_id: int, envelope_mac: bytes, secret: bytes
) -> list[int]:
    """Raises TransferRejected unless the trailer belongs to this transfer and envelope."""
    fields, _ = unseal("trailer", data, secret)
    if fields.get("transfer_id") != transfer_id or fields.get("env") != envelope_mac:
        raise TransferRejected("trailer does not belong to this envelope")
    sums: list[int] = np.frombuffer(fields["sums"], dtype="<u8").tolist()
    return sums


def encode_verdict(transfer_id: int, ok: bool, reason: str, secret: bytes) -> bytes:
    """Receiver -> sender: installed (ok) or rejected/cancelled (reason)."""
    frame, _ = seal("verdict", {"transfer_id": transfer_id, "ok": ok, "reason": reason}, secret)
    return frame


def decode_verdict(data: bytes | bytearray, transfer_id: int, secret: bytes) -> tuple[bool, str]:
    fields, _ = unseal("verdict", data, secret)
    if fields.get("transfer_id") != transfer_id:
        raise TransferRejected("verdict for another transfer")
    return bool(fields["ok"]), str(fields["reason"])


def encode_abort(transfer_id: int, reason: str, secret: bytes) -> bytes:
    """Sender -> receiver: stop waiting, free the reservation."""
    frame, _ = seal("abort", {"transfer_id": transfer_id, "reason": reason}, secret)
    return frame


def decode_abort(data: bytes | bytearray, transfer_id: int, secret: bytes) -> str:
    fields, _ = unseal("abort", data, secret)
    if fields.get("transfer_id") != transfer_id:
        raise TransferRejected("abort for another transfer")
    return str(fields["reason"])
