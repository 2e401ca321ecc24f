"""The GGUF container read directly: header, metadata values and the tensor index, in one pass.

A GGUF file (llama.cpp's format, version 2 or 3, little-endian) is

    magic "GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata:   key (u64 length + UTF-8) | value type u32 | value
    tensors:    name | dims count u32 | dims u64[n] (ggml order) | ggml type u32 | offset u64
    padding to `general.alignment` (default 32), then the tensor data, each at its offset.

The `gguf` package's own reader builds a NumPy view per element of every metadata array, which
for a 262,144-word vocabulary takes tens of seconds; here numeric arrays are read with one
`np.frombuffer` and string arrays with one pass over the bytes, so opening a file costs well under
a second. Tensor data stays memory-mapped; `gguf.quants.dequantize` still owns the quantised
formats (`jmarl.models.gguf.GGUFFile.array`).

Metadata values come back as plain Python: str (UTF-8, undecodable bytes replaced), int, bool,
float (float32 values as the shortest decimal that rounds to the stored float32, as config.json
spells them) or a list of these.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (gguf-py's GGUFValueType)
STRING, ARRAY, BOOL, FLOAT32 = 8, 9, 7, 6
_NUMERIC = {0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"), 4: np.dtype("<u4"),
            5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype("<u1"), 10: np.dtype("<u8"), 11: np.dtype("<i8"),
            12: np.dtype("<f8")}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands (the message says where and why)."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the index: `shape` in ggml order (fastest dimension first), `type_id` the
    raw ggml type number, `offset` the absolute byte offset of its data in the file."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int


@dataclass(frozen=True)
class GGUFContents:
    """A parsed GGUF header: `metadata` key -> Python value, `tensors` name -> entry (file
    order), `data` the whole file as a read-only uint8 memory map."""

    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorEntry]
    data: np.ndarray


class _Cursor:
    """Reads little-endian values from `buf`, advancing `pos`; running past the end raises."""

    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFFormatError(f"truncated at byte {self.pos}: {n} more bytes needed, {len(self.buf) - self.pos} left")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def string(self) -> str:
        return bytes(self.take(self.u64())).decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """`count` consecutive length-prefixed strings, in one pass over the bytes."""
        buf, pos, out = self.buf, self.pos, []
        end = len(buf)
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise GGUFFormatError(f"truncated string array at byte {pos}")
            (n,) = unpack(buf, pos)
            if pos + 8 + n > end:
                raise GGUFFormatError(f"truncated string array at byte {pos}")
            out.append(bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", errors="replace"))
            pos += 8 + n
        self.pos = pos
        return out


def _scalar(kind: int, raw: Any) -> Any:
    """A numeric metadata value as Python: bool for BOOL, the shortest decimal for FLOAT32."""
    if kind == BOOL:
        return bool(raw)
    if kind == FLOAT32:
        return float(str(np.float32(raw)))
    return raw.item() if isinstance(raw, np.generic) else raw


def _value(cur: _Cursor, kind: int) -> Any:
    """The metadata value of type `kind` at the cursor."""
    if kind == STRING:
        return cur.string()
    if kind in _NUMERIC:
        dtype = _NUMERIC[kind]
        return _scalar(kind, np.frombuffer(cur.take(dtype.itemsize), dtype)[0])
    if kind == ARRAY:
        item_kind, count = cur.u32(), cur.u64()
        if item_kind == STRING:
            return cur.strings(count)
        if item_kind in _NUMERIC:
            dtype = _NUMERIC[item_kind]
            values = np.frombuffer(cur.take(dtype.itemsize * count), dtype).tolist()
            if item_kind in (BOOL, FLOAT32):
                return [_scalar(item_kind, v) for v in values]
            return values
        return [_value(cur, item_kind) for _ in range(count)]
    raise GGUFFormatError(f"unknown metadata value type {kind} at byte {cur.pos}")


def read_gguf(path: str) -> GGUFContents:
    """The header of the GGUF file at `path` (its tensor data memory-mapped, not read).

    Raises GGUFFormatError on anything that is not a little-endian GGUF of version 2 or 3, on a
    truncated header, duplicate keys or tensor names, or tensor data outside the file."""
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
    except ValueError:  # NumPy cannot map an empty file
        raise GGUFFormatError("the file is empty") from None
    if bytes(data[:4]) != MAGIC:
        raise GGUFFormatError("no GGUF magic at the start of the file")
    cur = _Cursor(memoryview(data))
    cur.take(4)
    version = cur.u32()
    if version not in VERSIONS:
        hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise GGUFFormatError(f"GGUF version {version}{hint}; versions {VERSIONS} are supported")
    n_tensors, n_keys = cur.u64(), cur.u64()
    metadata: dict[str, Any] = {}
    for _ in range(n_keys):
        key = cur.string()
        if key in metadata:
            raise GGUFFormatError(f"metadata key {key!r} appears twice")
        metadata[key] = _value(cur, cur.u32())
    entries = []
    for _ in range(n_tensors):
        name = cur.string()
        shape = tuple(int(d) for d in np.frombuffer(cur.take(8 * cur.u32()), "<u8"))
        entries.append((name, shape, cur.u32(), cur.u64()))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment must be a power of two, got {alignment!r}")
    start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorEntry] = {}
    for name, shape, type_id, offset in entries:
        if name in tensors:
            raise GGUFFormatError(f"tensor {name!r} appears twice")
        if start + offset > data.size:
            raise GGUFFormatError(f"tensor {name!r} starts past the end of the file")
        tensors[name] = TensorEntry(name, shape, type_id, start + offset)
    return GGUFContents(version, metadata, tensors, data)
