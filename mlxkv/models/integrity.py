"""Weight files checked before anything reads them: a cut-off download is one clear line.

A safetensors file is an 8-byte header length, a JSON header giving each tensor's byte
range, then the data. An interrupted download leaves a file shorter than its header says;
MLX and the memory model would fail deep inside with a traceback.
"""

from __future__ import annotations

import struct
from pathlib import Path

from mlxkv.errors import UserError
from mlxkv.files import open_regular, parse_json

HEADER_LIMIT = 256 << 20  # bytes of a safetensors JSON header


def check_safetensors(path: Path) -> None:
    """Raise UserError if ``path`` is not a whole safetensors file (reads the header only)."""
    hint = "an interrupted download? delete it and download the model again"
    f, size = open_regular(path, "weight file")
    try:
        with f:
            (n,) = struct.unpack("<Q", f.read(8))
            if 8 + n > size or n > HEADER_LIMIT:
                raise ValueError
            header = parse_json(f.read(n).decode("utf-8"), str(path), max_depth=4)
        end = max(
            (info["data_offsets"][1] for k, info in header.items() if k != "__metadata__"),
            default=0,
        )
    except (struct.error, ValueError, KeyError, TypeError, IndexError, AttributeError, UserError):
        raise UserError(f"{path} is not a complete safetensors file ({hint})") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    if 8 + n + end > size:
        raise UserError(
            f"{path} is truncated: {size} bytes, its header needs {8 + n + end} ({hint})"
        )


def check_model_folder(folder: Path) -> None:
    """Every safetensors file of a model folder is whole."""
    for path in sorted(Path(folder).glob("*.safetensors")):
        check_safetensors(path)
