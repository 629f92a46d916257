"""MODEL for ``plan``: a config.json file, a model folder, a registry alias or a hub repo id.

Only config.json is fetched from the hub (and, for weights, the safetensors headers);
never a weight file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlxkv.errors import one_line
from mlxkv.memory.config import BadInput, load_config
from mlxkv.models.registry import load_registry, lookup
from mlxkv.models.resolve import looks_like_repo_id


@dataclass(frozen=True)
class ModelSource:
    name: str  # for display
    config: dict
    folder: Path | None  # local folder that may hold safetensors
    repo: str | None  # hub repo for safetensors metadata
    how: str  # how MODEL was resolved, for the user


def _hub_config(repo: str) -> Path:
    """config.json of a hub repo: the local HF cache first, else a download of that file."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(repo, "config.json")
    if isinstance(cached, str):
        return Path(cached)
    try:
        return Path(hf_hub_download(repo, "config.json"))
    except Exception as e:
        raise BadInput(
            f"could not fetch config.json of '{repo}' from the Hugging Face hub "
            f"({one_line(e)}); pass a local config.json or model folder"
        ) from None


def resolve(model: str) -> ModelSource:
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        # A GGUF holds no config.json: convert it (lossless, cached) and plan the result.
        from mlxkv.models.resolve import resolve as resolve_model

        folder = resolve_model(str(path)).path
        return ModelSource(path.stem, load_config(folder / "config.json"), folder, None, "GGUF")
    if path.is_file() or path.suffix == ".json":
        name = path.parent.name if path.name == "config.json" else path.stem
        return ModelSource(name or str(path), load_config(path), path.parent, None, "config file")
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.is_file():
            raise BadInput(f"{path} is a folder without config.json")
        return ModelSource(path.name, load_config(cfg), path, None, "local folder")
    entry = lookup(model)
    if entry is not None:
        from mlxkv.paths import models_dir

        local = models_dir() / entry.alias
        if (local / "config.json").is_file():
            return ModelSource(
                model, load_config(local / "config.json"), local, None, "alias (local copy)"
            )
        cfg = _hub_config(entry.hf_repo)
        return ModelSource(
            model, load_config(cfg), cfg.parent, entry.hf_repo, f"alias ({entry.hf_repo})"
        )
    if looks_like_repo_id(model):
        cfg = _hub_config(model)
        return ModelSource(model, load_config(cfg), cfg.parent, model, "hub")
    aliases = ", ".join(load_registry().models)
    raise BadInput(
        f"unknown model '{model}': not a config.json file, model folder, "
        + (f"registry alias ({aliases}) " if aliases else "registry alias ")
        + "or hub repo id (owner/name)"
    )
