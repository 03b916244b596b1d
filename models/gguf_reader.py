"""A GGUF file's header, key/value metadata and tensor infos, read with `struct`; the data mapped.

The `gguf` package's `GGUFReader` builds a numpy view for every part of every field: a
string is two views (its length, its bytes), so Llama 3.2's 128k-token vocabulary and
280k merges are about 0.8 M numpy slices, the most of a GGUF open's time. `GGUFFile` reads
the same documented layout (GGUF v2/v3, little-endian: magic "GGUF", version u32, tensor
count u64, key/value count u64; each key a u64-length string, a u32 value type and the
value, an array being a u32 element type, a u64 count and the elements; each tensor info
its name, u32 dims count, u64 dims in ggml order, u32 ggml type and u64 offset into the
data section, which starts at the next multiple of `general.alignment`, default 32) with
`struct.unpack_from` straight from the file's map, into plain Python values.

It keeps the small interface the loaders use of `GGUFReader`, with equal values: `fields`
(`{key: field}`; a field's `types`, `data` (its length: the array's count, or 1) and
`contents()`), `tensors` (`name`, `tensor_type`, `shape` in ggml order, `n_elements`,
`n_bytes`, `data_offset`, and `data`: a numpy view of the mapped bytes shaped as
GGUFReader shapes it), `data` (the file's `np.memmap`) and `alignment`;
tests/models/test_gguf_reader.py compares the two on every GGUF the tests write. Readers
of a LoRA adapter or a vision projector (`models/lora_gguf.py`, `models/siglip.py`) still
use GGUFReader: those files are small. A big-endian file is refused, as is every truncated
or malformed one, with a ValueError saying where it stops making sense.
"""

from __future__ import annotations

import os
import struct
from collections import OrderedDict
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_V = GGUFValueType
# Scalar value types: struct code (little-endian) and numpy dtype of an array of them.
_SCALARS = {
    _V.UINT8: ("<B", np.uint8), _V.INT8: ("<b", np.int8), _V.UINT16: ("<H", np.uint16), _V.INT16: ("<h", np.int16),
    _V.UINT32: ("<I", np.uint32), _V.INT32: ("<i", np.int32), _V.FLOAT32: ("<f", np.float32),
    _V.UINT64: ("<Q", np.uint64), _V.INT64: ("<q", np.int64), _V.FLOAT64: ("<d", np.float64), _V.BOOL: ("<?", np.bool_),
}
# Tensor types GGUFReader views as their elements; every other type is viewed as its bytes.
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFField:
    """One key's value as `GGUFReader`'s field gives it: `types` ([type] or [ARRAY, element
    type]), `data` (one entry per array element, or one for a scalar) and `contents()`."""

    __slots__ = ("offset", "name", "types", "value")

    def __init__(self, offset: int, name: str, types: list[GGUFValueType], value: Any) -> None:
        self.offset, self.name, self.types, self.value = offset, name, types, value

    @property
    def data(self) -> range:
        return range(len(self.value)) if self.types[0] == _V.ARRAY else range(1)

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        """The value: a str, a number or a bool, or (an array) a list of them, or the
        element at `index_or_slice` / the list of those in a slice."""
        if self.types[0] != _V.ARRAY:
            return self.value
        return self.value[index_or_slice]


class GGUFTensorInfo(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # ggml order (innermost first), uint64, as GGUFReader's
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray  # a view of the mapped file (numpy order; block types as bytes per row)


class GGUFFile:
    """The header, metadata and tensor infos of the GGUF file at `path`; its data memory-mapped
    read-only (module docstring). Raises ValueError for a file that is not a valid GGUF."""

    byte_order = "I"  # GGUFReader's: the host's order (a little-endian file on a little-endian host)

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        if os.path.getsize(self.path) == 0:
            raise ValueError("the file is empty")
        self.data = np.memmap(self.path, mode="r")
        self._buf = self.data._mmap
        self._size = len(self._buf)
        self.fields: OrderedDict[str, GGUFField] = OrderedDict()
        self.tensors: list[GGUFTensorInfo] = []
        self.alignment = DEFAULT_ALIGNMENT
        self._off = 0
        self._parse()

    # -- reading primitives, each checking the bytes are there ------------------------------

    def _fail(self, what: str) -> ValueError:
        return ValueError(f"{what} at byte {self._off} of {self._size}")

    def _take(self, n: int, what: str) -> int:
        start = self._off
        if n < 0 or start + n > self._size:
            raise self._fail(f"truncated: {what} needs {n} bytes")
        self._off = start + n
        return start

    def _scalar(self, code: str, what: str) -> Any:
        return struct.unpack_from(code, self._buf, self._take(struct.calcsize(code), what))[0]

    def _string(self, what: str) -> str:
        n = self._scalar("<Q", what)
        start = self._take(n, what)
        try:
            return str(self._buf[start:start + n], "utf-8")
        except UnicodeDecodeError as e:
            raise self._fail(f"{what} is not UTF-8 ({e.reason})") from None

    def _value_type(self, what: str) -> GGUFValueType:
        raw = self._scalar("<I", what)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self._fail(f"{what}: unknown value type {raw}") from None

    def _value(self, kind: GGUFValueType, what: str) -> tuple[list[GGUFValueType], Any]:
        if kind == _V.STRING:
            return [kind], self._string(what)
        if kind in _SCALARS:
            return [kind], self._scalar(_SCALARS[kind][0], what)
        # an array: element type, count, elements
        sub = self._value_type(what)
        count = self._scalar("<Q", what)
        if sub in _SCALARS:
            dtype = np.dtype(_SCALARS[sub][1])
            start = self._take(count * dtype.itemsize, f"{what} ({count} elements)")
            return [kind, sub], np.frombuffer(self._buf, dtype, count, start).tolist()
        if sub == _V.STRING:
            if count * 8 > self._size - self._off:  # each string has at least its 8-byte length
                raise self._fail(f"truncated: {what} claims {count} strings")
            return [kind, sub], self._strings(count, what)
        values, types = [], [kind]
        for _ in range(count):  # nested arrays: not written by llama.cpp, but valid
            types_i, value = self._value(sub, what)
            values.append(value)
            types = [kind] + types_i
        return types, values

    def _strings(self, count: int, what: str) -> list[str]:
        """`count` length-prefixed strings: the vocabulary's tokens and merges, so the loop is lean."""
        buf, off, size, out = self._buf, self._off, self._size, []
        unpack = struct.Struct("<Q").unpack_from
        append = out.append
        try:
            for _ in range(count):
                n = unpack(buf, off)[0]
                off += 8
                end = off + n
                if end > size:
                    break
                append(str(buf[off:end], "utf-8"))
                off = end
        except (struct.error, UnicodeDecodeError) as e:
            self._off = off
            raise self._fail(f"{what}: entry {len(out)} is cut off or not UTF-8 ({e})") from None
        self._off = off
        if len(out) != count:
            raise self._fail(f"truncated: {what} entry {len(out)} of {count} runs past the end")
        return out

    # -- the layout ------------------------------------------------------------------------

    def _parse(self) -> None:
        if self._size < 4 or self._buf[:4] != MAGIC:
            raise ValueError("GGUF magic invalid: the file does not start with 'GGUF'")
        self._off = 4
        version = self._scalar("<I", "the version")
        if version & 0xFFFF == 0 and version:
            raise ValueError("a big-endian GGUF file: only little-endian files are supported; "
                             "convert it with llama.cpp's gguf tools")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (versions {VERSIONS})")
        self.fields["GGUF.version"] = GGUFField(4, "GGUF.version", [_V.UINT32], version)
        tensor_count = self._scalar("<Q", "the tensor count")
        self.fields["GGUF.tensor_count"] = GGUFField(8, "GGUF.tensor_count", [_V.UINT64], tensor_count)
        kv_count = self._scalar("<Q", "the metadata count")
        self.fields["GGUF.kv_count"] = GGUFField(16, "GGUF.kv_count", [_V.UINT64], kv_count)
        for i in range(kv_count):
            start = self._off
            key = self._string(f"metadata key {i} of {kv_count}")
            types, value = self._value(self._value_type(f"the type of {key!r}"), f"the value of {key!r}")
            if key in self.fields:
                raise self._fail(f"duplicate metadata key {key!r}")
            self.fields[key] = GGUFField(start, key, types, value)
        infos = [self._tensor_info(i, tensor_count) for i in range(tensor_count)]
        align = self.fields.get("general.alignment")
        if align is not None:
            if align.types != [_V.UINT32] or align.value == 0 or align.value & (align.value - 1):
                raise ValueError("general.alignment must be a u32 power of two")
            self.alignment = align.value
        self.data_offset = -(-self._off // self.alignment) * self.alignment
        self._build_tensors(infos)

    def _tensor_info(self, i: int, count: int) -> tuple[str, list[int], int, int]:
        name = self._string(f"tensor info {i} of {count}")
        n_dims = self._scalar("<I", f"tensor {name!r}'s dims count")
        if n_dims > 8:
            raise self._fail(f"tensor {name!r} claims {n_dims} dims")
        dims = list(struct.unpack_from(f"<{n_dims}Q", self._buf, self._take(8 * n_dims, f"tensor {name!r}'s dims")))
        raw_type = self._scalar("<I", f"tensor {name!r}'s type")
        offset = self._scalar("<Q", f"tensor {name!r}'s offset")
        return name, dims, raw_type, offset

    def _build_tensors(self, infos: list) -> None:
        plain = self.data.view(np.ndarray)  # slices of a plain view skip memmap's per-slice bookkeeping
        seen = set()
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise ValueError(f"tensor {name!r} appears twice in the tensor infos")
            seen.add(name)
            try:
                ggml_type = GGMLQuantizationType(raw_type)
            except ValueError:
                raise ValueError(f"tensor {name!r} has unknown ggml type {raw_type}") from None
            n_elements = int(np.prod(dims, dtype=np.uint64)) if dims else 1
            block, type_size = GGML_QUANT_SIZES[ggml_type]
            if n_elements % block:
                raise ValueError(f"tensor {name!r}: {n_elements} elements are not whole {ggml_type.name} blocks")
            n_bytes = n_elements * type_size // block
            start = self.data_offset + offset
            if start + n_bytes > self._size:
                raise ValueError(f"truncated: tensor {name!r} ends at byte {start + n_bytes} but the file "
                                 f"has {self._size}")
            np_dims = tuple(reversed(dims))
            dtype = _ELEMENT_DTYPES.get(ggml_type)
            if dtype is None:
                dtype, np_dims = np.uint8, quant_shape_to_byte_shape(np_dims, ggml_type)
            view = plain[start:start + n_bytes].view(dtype).reshape(np_dims)
            self.tensors.append(GGUFTensorInfo(name, ggml_type, np.array(dims, np.uint64), n_elements, n_bytes,
                                               start, view))
