"""The JSON table at the head of a safetensors file (model weights), read and checked
without reading the data: an 8-byte length, then ``{name: {dtype, shape, data_offsets}}``.

A crafted or damaged table must be one clear line, never a traceback deep in the memory
model or MLX: every entry needs a dtype safetensors defines, a shape of non-negative
integers and a byte range that matches it, and no two ranges may overlap (a small file
whose tensors all name the same bytes would load as gigabytes).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from mlxkv.errors import UserError
from mlxkv.files import open_regular, parse_json, shared_bytes

HEADER_LIMIT = 100_000_000  # bytes of a safetensors JSON header, as safetensors' own limit
# Tensors one file may name: a 30B MoE's file holds ~60k; a crafted table of 2.5M empty
# tensors took 1.7 GB to read. Counted in the raw header, before it is parsed.
MAX_TENSORS = 1 << 18
MAX_DIMS = 8  # weights have at most 5 (a 3-D convolution's); a long list is a crafted one
# safetensors dtype -> (bytes per element, floating)
DTYPES = {
    "F64": (8, True),
    "F32": (4, True),
    "F16": (2, True),
    "BF16": (2, True),
    "F8_E4M3": (1, True),
    "F8_E5M2": (1, True),
    "I64": (8, False),
    "I32": (4, False),
    "U32": (4, False),
    "I16": (2, False),
    "U16": (2, False),
    "I8": (1, False),
    "U8": (1, False),
    "BOOL": (1, False),
}
HINT = "an interrupted download? delete it and download the model again"


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # safetensors spelling
    numel: int
    end: int  # where its data ends, from the start of the data
    start: int = 0  # where its data starts


def read_table(path: Path) -> tuple[list[Tensor], int]:
    """(the tensors of ``path``, the bytes its header and data need); UserError naming what
    is wrong when the table is not one safetensors defines."""
    f, size = open_regular(path, "weight file")
    try:
        with f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > HEADER_LIMIT and 8 + n <= size:
                raise UserError(
                    f"{path} has a table of {n:,} bytes, more than the {HEADER_LIMIT:,} "
                    f"safetensors allows ({HINT})"
                )
            if 8 + n > size:
                raise ValueError
            raw = f.read(n)
    except (struct.error, ValueError):
        raise UserError(f"{path} is not a complete safetensors file ({HINT})") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    if raw.count(b'"data_offsets"') > MAX_TENSORS:
        raise UserError(
            f"{path} names more than {MAX_TENSORS:,} tensors; a model's weight file holds "
            f"far fewer ({HINT})"
        )
    try:
        table = parse_json(raw.decode("utf-8"), str(path), max_depth=4)
    except (ValueError, UserError):
        raise UserError(f"{path} is not a complete safetensors file ({HINT})") from None
    if not isinstance(table, dict):
        raise UserError(f"{path} is not a safetensors file (its header is not a table)")
    tensors = [_tensor(path, name, info) for name, info in table.items() if name != "__metadata__"]
    if not tensors:
        raise UserError(f"{path} holds no tensors; it is not a model's weight file")
    shared = shared_bytes({t.name: (t.start, t.end) for t in tensors})
    if shared:
        a, b = shared
        raise UserError(
            f"{path}: tensors {a[:60]!r} and {b[:60]!r} share bytes; each tensor has its "
            f"own in a safetensors file ({HINT})"
        )
    return tensors, 8 + n + max((t.end for t in tensors), default=0)


def _tensor(path: Path, name: str, info) -> Tensor:
    def bad(why: str) -> UserError:
        return UserError(f"{path}: tensor {name[:60]!r} {why} ({HINT})")

    if not isinstance(info, dict):
        raise bad("is not a table")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise bad(f"has no dtype safetensors defines (got {str(dtype)[:20]!r})")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad("has a shape that is not a list of non-negative integers")
    if len(shape) > MAX_DIMS:
        raise bad(f"has {len(shape)} dimensions; weights have at most {MAX_DIMS}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise bad("has no valid data_offsets")
    numel = 1
    for d in shape:
        numel *= d
    if offsets[1] - offsets[0] != numel * DTYPES[dtype][0]:
        raise bad("has data_offsets that do not match its shape and dtype")
    return Tensor(name, dtype, numel, offsets[1], offsets[0])
