"""Read and check a GGUF file's header before MLX touches it.

MLX's loader trusts the file; a truncated or foreign file must be refused here with a
clear message instead (a short read deep in C++ gives no useful error).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

from mlxkv.errors import UserError
from mlxkv.files import open_regular

# ggml tensor types: name, elements per block, bytes per block
GGML_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    30: ("BF16", 1, 2),
}
SUPPORTED_TYPES = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0")

# metadata value types: struct format (None for the variable-length ones)
_SCALARS = {
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
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFArray:
    """An array in the metadata: only its item type and length are kept (MLX reads it)."""

    item_type: int
    n: int

    @property
    def of_strings(self) -> bool:
        return self.item_type == _STRING

    @property
    def of_ints(self) -> bool:
        return self.item_type in _INTS


_INTS = (0, 1, 2, 3, 4, 5, 10, 11)
MAX_DIMS = 4  # GGML_MAX_DIMS: ggml (and MLX's reader) has room for four


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    type_name: str
    offset: int
    nbytes: int


@dataclass
class GGUFHeader:
    version: int
    metadata: dict = field(default_factory=dict)  # scalars and strings; arrays as GGUFArray
    tensors: list[TensorInfo] = field(default_factory=list)
    data_start: int = 0


class _Reader:
    def __init__(self, data: bytes, path: Path):
        self.data, self.pos, self.path = data, 0, path

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise UserError(f"{self.path}: GGUF header is truncated; download the file again")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("Q")
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, n = self.unpack("I"), self.unpack("Q")
            if item_type in _SCALARS:
                self.take(n * struct.calcsize(_SCALARS[item_type]))
            elif item_type == _STRING:
                for _ in range(n):
                    self.take(self.unpack("Q"))
            else:
                what = "nested arrays" if item_type == _ARRAY else f"value type {item_type}"
                raise UserError(f"{self.path}: GGUF metadata with {what} is not supported")
            return GGUFArray(item_type, n)  # vocabularies are read by MLX
        raise UserError(f"{self.path}: corrupt GGUF metadata (value type {vtype})")


def read_header(path: Path) -> GGUFHeader:
    """Parse the header and check that every tensor's bytes are inside the file."""
    path = Path(path)
    f, size = open_regular(path, "GGUF file")
    try:
        with f:  # vocabularies make headers a few MB; read generously, once
            data = f.read(min(size, 64 << 20))
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    if data[:4] != b"GGUF":
        raise UserError(f"{path} is not a GGUF file (bad magic bytes)")
    r = _Reader(data, path)
    r.take(4)
    header = GGUFHeader(version=r.unpack("I"))
    if header.version not in (2, 3):
        raise UserError(f"{path}: GGUF version {header.version} is not supported (2 or 3)")
    n_tensors, n_kv = r.unpack("Q"), r.unpack("Q")
    for _ in range(n_kv):
        key = r.string()
        header.metadata[key] = r.value(r.unpack("I"))
    for _ in range(n_tensors):
        name = r.string()
        n_dims = r.unpack("I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise UserError(
                f"{path}: GGUF tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS} allowed); "
                "the file is corrupt"
            )
        dims = tuple(r.unpack("Q") for _ in range(n_dims))
        type_id, offset = r.unpack("I"), r.unpack("Q")
        tname, block, block_bytes = GGML_TYPES.get(type_id, (f"type {type_id}", 1, 0))
        if 0 in dims or dims[0] % block:
            raise UserError(
                f"{path}: GGUF tensor {name} has shape {list(dims)}, which {tname} blocks of "
                f"{block} cannot hold; the file is corrupt"
            )
        n = 1
        for d in dims:
            n *= d
        header.tensors.append(TensorInfo(name, dims[::-1], tname, offset, n // block * block_bytes))
    align = header.metadata.get("general.alignment", 32)
    if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
        raise UserError(
            f"{path}: GGUF general.alignment {align!r} is not a positive power of two; "
            "the file is corrupt"
        )
    header.data_start = (r.pos + align - 1) // align * align
    for t in header.tensors:
        if t.offset % align:
            raise UserError(
                f"{path}: GGUF tensor {t.name} is not aligned to {align} bytes; the file is corrupt"
            )
        if header.data_start + t.offset + t.nbytes > size:
            raise UserError(
                f"{path} is truncated: tensor {t.name} ends past the end of the file "
                f"({size} bytes); download the file again"
            )
    return header


def check_supported(header: GGUFHeader, path: Path, architectures: tuple[str, ...]) -> str:
    """Refuse architectures and tensor types the importer cannot convert losslessly."""
    arch = header.metadata.get("general.architecture", "?")
    if arch not in architectures:
        raise UserError(
            f"{path}: GGUF architecture '{arch}' is not supported; supported: "
            + ", ".join(architectures)
        )
    bad = sorted({t.type_name for t in header.tensors if t.type_name not in SUPPORTED_TYPES})
    if bad:
        raise UserError(
            f"{path}: GGUF tensor type(s) {', '.join(bad)} not supported; supported: "
            + ", ".join(SUPPORTED_TYPES)
        )
    return arch
