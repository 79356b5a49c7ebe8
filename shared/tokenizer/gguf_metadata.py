"""Read the key/value metadata of a GGUF file without touching its tensors.

``gguf.GGUFReader`` parses every array element into its own numpy view, which takes ~1.5 s on
SmolLM2's 49k-token vocabulary; the router only needs the metadata, so this reader walks the
header once with ``struct`` and stops before the tensor infos (~0.1 s).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

from shared.errors import ModelLoadError

_MAGIC = b"GGUF"

# GGUF value type -> struct format (little endian); 8 = string, 9 = array.
_SCALAR_FORMATS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING = 8
_ARRAY = 9


class _Cursor:
    """Sequential little-endian reader over a binary file. Raises ModelLoadError at EOF."""

    def __init__(self, fh: BinaryIO, path: Path) -> None:
        self._fh = fh
        self._path = path

    def take(self, num_bytes: int) -> bytes:
        data = self._fh.read(num_bytes)
        if len(data) != num_bytes:
            raise ModelLoadError(f"{self._path}: GGUF metadata is truncated")
        return data

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        return struct.unpack("<" + fmt, self.take(size))[0]

    def string(self) -> str:
        length = self.scalar("Q")
        return self.take(length).decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type = self.scalar("I")
            count = self.scalar("Q")
            if item_type in _SCALAR_FORMATS:
                fmt = _SCALAR_FORMATS[item_type]
                size = struct.calcsize("<" + fmt)
                raw = self.take(size * count)
                return list(struct.unpack(f"<{count}{fmt}", raw))
            return [self.value(item_type) for _ in range(count)]
        raise ModelLoadError(f"{self._path}: unknown GGUF value type {value_type}")


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Return every metadata key of the GGUF file at ``path`` (arrays as lists).

    Raises ModelLoadError if the file is missing, not GGUF, or truncated. Reads only the header.
    """
    gguf_path = Path(path)
    try:
        with gguf_path.open("rb") as fh:
            cursor = _Cursor(fh, gguf_path)
            if cursor.take(4) != _MAGIC:
                raise ModelLoadError(f"{gguf_path}: not a GGUF file (bad magic)")
            version = cursor.scalar("I")
            if version not in (2, 3):
                raise ModelLoadError(f"{gguf_path}: unsupported GGUF version {version}")
            cursor.scalar("Q")  # tensor count: not needed here
            kv_count = cursor.scalar("Q")
            metadata: dict[str, Any] = {}
            for _ in range(kv_count):
                key = cursor.string()
                metadata[key] = cursor.value(cursor.scalar("I"))
            return metadata
    except OSError as exc:
        raise ModelLoadError(f"{gguf_path}: cannot read GGUF file: {exc}") from exc
