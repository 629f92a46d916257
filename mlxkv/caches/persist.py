"""Save / load per-layer caches with mlx-lm's own ``save_prompt_cache`` / ``load_prompt_cache``.

Every cache's ``state`` carries its arrays and scalars (mlx-lm 0.32.2's format), so a file
written here loads with plain mlx-lm too once ``mlxkv.caches`` is imported (which makes
mlx-lm's loader find mlxkv's class names). The file's string metadata adds ``mlxkv_cache``
(format version) and ``metadata`` (the caller's dict as JSON: model id, policy, dtype,
token ids, ...). ``load_caches`` compares every key of ``expect_metadata`` with what was
saved and refuses a mismatch, so a cache never lands in another model or under another policy.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from mlxkv.caches.errors import CacheError
from mlxkv.caches.full import FullKVCache
from mlxkv.caches.kivi import KiviKVCache
from mlxkv.caches.streaming import QuantizedStreamingKVCache, StreamingKVCache
from mlxkv.files import atomic_write_with

FORMAT = "2"
MLXKV_CLASSES = (FullKVCache, StreamingKVCache, QuantizedStreamingKVCache, KiviKVCache)


def register_with_mlx_lm() -> None:
    """mlx-lm's ``load_prompt_cache`` resolves a saved class by its name in
    ``mlx_lm.models.cache``: add mlxkv's cache classes there (no mlx-lm name is replaced)."""
    for cls in MLXKV_CLASSES:
        if getattr(mlx_cache, cls.__name__, cls) is not cls:
            raise CacheError(f"mlx-lm already defines a cache named {cls.__name__}")
        setattr(mlx_cache, cls.__name__, cls)


def save_caches(path, caches: list, metadata: dict) -> None:
    """Write ``caches`` and ``metadata`` (JSON-able dict) to ``path`` (.safetensors),
    atomically (:func:`mlxkv.files.atomic_file`)."""
    register_with_mlx_lm()
    path = Path(path)
    for c in caches:
        if type(c).__name__ not in {k.__name__ for k in MLXKV_CLASSES} and not hasattr(
            mlx_cache, type(c).__name__
        ):
            raise CacheError(f"cannot save a cache of unknown class {type(c).__name__}")
    header = {"mlxkv_cache": FORMAT, "metadata": json.dumps(metadata, sort_keys=True)}
    atomic_write_with(
        path, lambda f: mlx_cache.save_prompt_cache(f, caches, header), what="--prompt-cache"
    )


def _header(path) -> dict:
    path = Path(path)
    if not path.exists():
        raise CacheError(f"no saved cache at {path}")
    try:
        _, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:  # corrupt or not safetensors
        raise CacheError(f"{path} is not a readable cache file ({e})") from None
    # save_prompt_cache flattens [metadata, classes, scalars]: ours is the "0." part
    meta = {k[2:]: v for k, v in meta.items() if k.startswith("0.")}
    if meta.get("mlxkv_cache") != FORMAT:
        raise CacheError(f"{path} is not an mlxkv cache file (format {FORMAT})")
    return meta


def read_metadata(path) -> dict:
    """The caller metadata stored in a saved cache file."""
    return json.loads(_header(path)["metadata"])


def check_metadata(path, saved: dict, expect_metadata: dict) -> None:
    """Raise :class:`CacheError` (one line) unless ``saved`` matches ``expect_metadata``."""
    for key, want in expect_metadata.items():
        have = saved.get(key)
        if json.dumps(have, sort_keys=True) != json.dumps(want, sort_keys=True):
            raise CacheError(
                f"saved cache {Path(path).name} was made with {key}={json.dumps(have)}, "
                f"this session has {key}={json.dumps(want)}"
            )


def load_caches(path, expect_metadata: dict) -> list:
    """Load caches saved by :func:`save_caches`, refusing them unless every key of
    ``expect_metadata`` (e.g. model, policy, dtype) matches what was saved."""
    check_metadata(path, read_metadata(path), expect_metadata)
    register_with_mlx_lm()
    try:
        return mlx_cache.load_prompt_cache(str(path))
    except Exception as e:
        raise CacheError(f"{path} is not a readable cache file ({e})") from None
