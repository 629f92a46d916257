"""Where mlxkv keeps its files: ``$MLXKV_HOME`` or ``~/.cache/mlxkv``."""

from __future__ import annotations

import os
from pathlib import Path

from mlxkv.errors import UserError


def home() -> Path:
    env = os.environ.get("MLXKV_HOME")
    if not env:
        return Path.home() / ".cache" / "mlxkv"
    path = Path(env).expanduser()
    if path.exists() and not path.is_dir():
        raise UserError(f"MLXKV_HOME={env} is not a directory; point it at a folder or unset it")
    return path


def models_dir() -> Path:
    return home() / "models"


def downloads_dir() -> Path:
    return home() / "downloads"
