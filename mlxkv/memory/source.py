"""What the memory model reads about a model: its config.json and where its weights are.

``from_path`` reads a local config.json or model folder. Registry aliases, hub repo ids
and GGUF files are turned into a ``ModelSource`` by ``mlxkv.models.resolve.resolve_config``
(the one MODEL resolver), which ends here for anything local.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlxkv.memory.config import BadInput, load_config


@dataclass(frozen=True)
class ModelSource:
    name: str  # for display
    config: dict
    folder: Path | None  # local folder that may hold safetensors
    repo: str | None  # hub repo for safetensors metadata
    how: str  # how MODEL was resolved, for the user


def from_path(path: Path, name: str | None = None, how: str | None = None) -> ModelSource:
    """A local config.json file or model folder."""
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.is_file():
            raise BadInput(f"{path} is a folder without config.json")
        shown = name or path.resolve().name  # "." names the folder it is
        return ModelSource(shown, load_config(cfg), path, None, how or "local folder")
    default = path.parent.name if path.name == "config.json" else path.stem
    return ModelSource(
        name or default or str(path), load_config(path), path.parent, None, how or "config file"
    )
