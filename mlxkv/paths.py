"""Where mlxkv keeps its files: ``$MLXKV_HOME`` or ``~/.cache/mlxkv``."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    env = os.environ.get("MLXKV_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mlxkv"


def models_dir() -> Path:
    return home() / "models"


def downloads_dir() -> Path:
    return home() / "downloads"
