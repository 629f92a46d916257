"""Weight files checked before anything reads them: a cut-off download is one clear line.

A safetensors file is an 8-byte header length, a JSON header giving each tensor's byte
range, then the data. An interrupted download leaves a file shorter than its header says;
MLX and the memory model would fail deep inside with a traceback.
"""

from __future__ import annotations

from pathlib import Path

from mlxkv.errors import UserError
from mlxkv.safetensors_table import HINT, read_table


def check_safetensors(path: Path) -> None:
    """Raise UserError if ``path`` is not a whole safetensors file (reads the header only)."""
    _, need = read_table(path)
    size = path.stat().st_size
    if need > size:
        raise UserError(f"{path} is truncated: {size} bytes, its header needs {need} ({HINT})")


def check_model_folder(folder: Path) -> None:
    """Every safetensors file of a model folder is whole."""
    for path in sorted(Path(folder).glob("*.safetensors")):
        check_safetensors(path)
