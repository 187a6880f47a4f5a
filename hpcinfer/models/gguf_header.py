"""A GGUF file's header in one pass: metadata as plain Python values, tensor infos, data offset.

NOTE: why not `gguf.GGUFReader` for the header: it builds a numpy memmap view for every part of
every field, and a vocabulary is two fields of ~50k strings each, so opening SmolLM2's file took
1.9 s of a 7 s one-chat run. Here numeric arrays are one `frombuffer` each and a string array one
pass over its bytes (~0.1 s). The format is GGUF v2/v3 as llama.cpp's `gguf` package writes it;
the tensors' data is still dequantized by `gguf` (models/gguf_checkpoint.py), and the tests read
every file this way and compare against `transformers` loading it through `gguf`'s own reader.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
# GGUF value types -> (struct format, numpy dtype) for the fixed-size ones; 8 is a string, 9 an array
_SCALARS = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: innermost dimension first
    tensor_type: int  # a GGMLQuantizationType value
    offset: int  # from the start of the data section


@dataclass(slots=True)
class GGUFHeader:
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_offset: int  # where the data section starts in the file


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.at = buf, 0

    def scalar(self, kind: int) -> Any:
        fmt, _ = _SCALARS[kind]
        (value,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.buf, self.at)
        start = self.at + 8
        self.at = start + n
        return bytes(self.buf[start : self.at]).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = struct.unpack_from("<IQ", self.buf, self.at)
            self.at += 12
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
            end = self.at + count * dtype.itemsize
            raw = bytes(self.buf[self.at : end])  # NOTE: a copy: no view may outlive the mapping
            self.at = end
            return np.frombuffer(raw, dtype=dtype).tolist()
        return self.scalar(kind)


def read_header(file: Path) -> GGUFHeader:
    """Parses the header; ValueError (struct.error, KeyError) on a file that is not GGUF v2/v3."""
    with open(file, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        buf = memoryview(mapped)
        try:
            if bytes(buf[:4]) != MAGIC:
                raise ValueError("not a GGUF file (bad magic)")
            version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
            cursor = _Cursor(buf)
            cursor.at = 24
            metadata: dict[str, Any] = {}
            for _ in range(kv_count):
                key = cursor.string()
                (kind,) = struct.unpack_from("<I", buf, cursor.at)
                cursor.at += 4
                metadata[key] = cursor.value(kind)
            tensors: dict[str, TensorInfo] = {}
            for _ in range(tensor_count):
                name = cursor.string()
                (dims,) = struct.unpack_from("<I", buf, cursor.at)
                shape = struct.unpack_from(f"<{dims}Q", buf, cursor.at + 4)
                kind, offset = struct.unpack_from("<IQ", buf, cursor.at + 4 + 8 * dims)
                cursor.at += 4 + 8 * dims + 12
                tensors[name] = TensorInfo(name, tuple(int(d) for d in shape), int(kind), int(offset))
            alignment = int(metadata.get("general.alignment", 32))
            data_offset = -(-cursor.at // alignment) * alignment
        finally:
            buf.release()
    return GGUFHeader(metadata, tensors, data_offset)


__all__ = ["GGUFHeader", "TensorInfo", "read_header"]
