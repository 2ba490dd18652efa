"""A GGUF file's metadata and tensor table, read in one pass over its header.

gguf-py's GGUFReader builds a numpy view per field part (two per vocabulary string), which took
seconds for a 49k-token vocabulary; this reads the same header with `struct` and hands out the
tensors as read-only views of the memory-mapped file, in gguf-py's shapes and types (so
`gguf.quants.dequantize` takes them). Little-endian GGUF versions 2 and 3.
"""
from __future__ import annotations

import dataclasses
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9
_ITEM_BYTES = {**{k: struct.calcsize(f) for k, f in _SCALARS.items()}, _STRING: 8, _ARRAY: 12}   # at least
MAX_ARRAY_DEPTH = 4   # arrays of arrays: GGUF writers use none; a deeper file is built to exhaust the stack
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `shape` is GGUF's dims (innermost first), `data` its bytes as gguf-py gives them."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFFile:
    """`fields`: the key/value metadata as Python values (lists for arrays); `tensors` in file order."""

    def __init__(self, path: str | Path):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = memoryview(self._map)
        self._pos = 0
        magic, version = self._take("<4sI")
        if magic != b"GGUF":
            raise ValueError(f"bad magic {magic!r}")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (this reader takes 2 and 3)")
        n_tensors, n_fields = self._take("<QQ")
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._take("<I")[0])
        infos = [(self._string(), *self._tensor_info()) for _ in range(n_tensors)]
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = [self._tensor(name, dims, qtype, start + offset) for name, dims, qtype, offset in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicated tensor names")

    def _take(self, fmt: str) -> tuple[Any, ...]:
        out = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        (n,) = self._take("<Q")
        if self._pos + n > len(self._buf):
            raise ValueError("a string runs past the end of the file")
        s = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8")
        self._pos += n
        return s

    def _value(self, kind: int, depth: int = 0) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._take("<IQ")
            self._check_array(item, count, depth)
            if item == _STRING:
                return [self._string() for _ in range(count)]
            if item == _ARRAY:
                return [self._value(_ARRAY, depth + 1) for _ in range(count)]
            values = np.frombuffer(self._buf, _NUMPY[item], count, self._pos)
            self._pos += values.nbytes
            return values.tolist()
        return self._take(_SCALARS[kind])[0]

    def _check_array(self, item: int, count: int, depth: int) -> None:
        """Refuse an array before building it: one that cannot fit in the rest of the file (each item
        takes at least its header's bytes; a count of small strings would be a list of billions), or
        nested deeper than MAX_ARRAY_DEPTH."""
        if item not in _ITEM_BYTES:
            raise ValueError(f"an array of unknown item type {item}")
        if count * _ITEM_BYTES[item] > len(self._buf) - self._pos:
            raise ValueError(f"an array of {count} items cannot fit in the rest of the file")
        if item == _ARRAY and depth >= MAX_ARRAY_DEPTH:
            raise ValueError(f"arrays nested deeper than {MAX_ARRAY_DEPTH}")

    def _tensor_info(self) -> tuple[tuple[int, ...], GGMLQuantizationType, int]:
        (n_dims,) = self._take("<I")
        dims = self._take(f"<{n_dims}Q")
        qtype, offset = self._take("<IQ")
        return dims, GGMLQuantizationType(qtype), offset

    def _tensor(self, name: str, dims: tuple[int, ...], qtype: GGMLQuantizationType, offset: int) -> GGUFTensor:
        block, size = GGML_QUANT_SIZES[qtype]
        n_elems = int(np.prod(dims))
        shape = tuple(reversed(dims))
        if qtype in _PLAIN:
            dtype, count = np.dtype(_PLAIN[qtype]), n_elems
        else:
            dtype, count, shape = np.dtype(np.uint8), n_elems * size // block, quant_shape_to_byte_shape(shape, qtype)
        if offset + count * dtype.itemsize > len(self._buf):
            raise ValueError(f"tensor {name} runs past the end of the file")
        data = np.frombuffer(self._buf, dtype, count, offset).reshape(shape)
        return GGUFTensor(name, qtype, tuple(int(d) for d in dims), data)
