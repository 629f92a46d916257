"""Save / load per-layer caches to one safetensors file (arrays + JSON metadata, no pickle).

The file's string metadata holds ``mlxkv_cache`` (format version), ``metadata`` (the
caller's dict as JSON: model id, policy, dtype, ...) and ``layers`` (per cache: class,
non-array state, array names). ``load_caches`` compares every key of ``expect_metadata``
with what was saved and refuses a mismatch, so a cache never lands in another model or
under another policy.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_cache

from mlxkv.caches.errors import CacheError
from mlxkv.caches.full import FullKVCache
from mlxkv.caches.rotation import Identity, Rotation
from mlxkv.caches.streaming import QuantizedStreamingKVCache, StreamingKVCache

FORMAT = "1"
_OURS = {c.__name__: c for c in (FullKVCache, StreamingKVCache, QuantizedStreamingKVCache)}


def _flatten(prefix: str, tree, arrays: dict) -> list:
    """Arrays go to ``arrays``; returns [(path, json-able leaf or {"array": key})]."""
    out = []
    for path, leaf in tree_flatten(tree):
        if isinstance(leaf, mx.array):
            key = f"{prefix}{path}"
            arrays[key] = leaf
            out.append((path, {"array": key}))
        elif leaf is None or isinstance(leaf, (int, float, bool, str)):
            out.append((path, leaf))
        else:
            raise CacheError(f"cannot save cache state of type {type(leaf).__name__}")
    return out


def _unflatten(leaves: list, arrays: dict):
    items = [(p, arrays[v["array"]] if isinstance(v, dict) else v) for p, v in leaves]
    return tree_unflatten(items)


def _record(i: int, cache, arrays: dict) -> dict:
    name = type(cache).__name__
    if isinstance(cache, StreamingKVCache):
        rec = {
            "class": name,
            "meta": list(cache.meta_state),
            "store": _stores(cache),
            "state": _flatten(f"{i}.state.", list(cache.state), arrays),
        }
        rot = cache.rotation
        if isinstance(rot, Rotation):
            rec["rotation"] = rot.describe()
            if rot.freqs is not None:
                arrays[f"{i}.rotation.freqs"] = rot.freqs
        elif isinstance(rot, Identity):
            rec["rotation"] = rot.describe()
        return rec
    if name not in _OURS and not hasattr(mlx_cache, name):
        raise CacheError(f"cannot save a cache of unknown class {name}")
    return {"class": name, "state": _flatten(f"{i}.state.", cache.state, arrays)}


def _stores(cache) -> dict:
    if isinstance(cache, QuantizedStreamingKVCache):
        return cache.describe_stores()
    return {}


def _quantized(store: dict) -> QuantizedStreamingKVCache:
    """The empty cache a saved store description names (files from before separate key and
    value stores hold one mlx-lm style description for both)."""
    if "keys" not in store:
        store = {"keys": {**store, "scheme": "plain"}, "values": store}
    k, v = store["keys"], store["values"]
    if k.get("scheme", "plain") not in ("plain", "rotated"):
        raise CacheError(f"saved cache uses key scheme {k['scheme']!r}, unknown to this mlxkv")
    return QuantizedStreamingKVCache(
        None,
        0,
        None,
        None,
        k.get("group_size", 64),
        key_bits=k.get("bits"),
        value_bits=v.get("bits"),
        value_group_size=v.get("group_size"),
        key_scheme=k.get("scheme", "plain"),
    )


def _tuples(x):
    # safetensors round trips lists; quantized storage is a tuple (packed, scales, biases)
    return tuple(x) if isinstance(x, list) else x


def _restore(i: int, rec: dict, arrays: dict):
    name = rec["class"]
    state = _unflatten(rec["state"], arrays) if rec["state"] else []
    if name in ("StreamingKVCache", "QuantizedStreamingKVCache"):
        state = list(state) + [None] * (4 - len(state))
        rot = rec.get("rotation")
        rotation = None
        if rot and rot.get("identity"):
            rotation = Identity()
        elif rot:
            freqs = arrays.get(f"{i}.rotation.freqs")
            rotation = Rotation(rot["dims"], rot["traditional"], rot["base"], rot["scale"], freqs)
        quantized = name == "QuantizedStreamingKVCache"
        c = _quantized(rec["store"]) if quantized else StreamingKVCache(None)
        c.meta_state = rec["meta"]
        c.rotation = rotation
        c.keys, c.values, c.sink_keys = (_tuples(s) for s in state[:3])
        if state[3] is not None:
            c.kstore.offset = state[3]
        return c
    cls = _OURS.get(name) or getattr(mlx_cache, name)
    return cls.from_state(state)


def save_caches(path, caches: list, metadata: dict) -> None:
    """Write ``caches`` and ``metadata`` (JSON-able dict) to ``path`` (.safetensors)."""
    arrays: dict = {}
    layers = [_record(i, c, arrays) for i, c in enumerate(caches)]
    mx.eval(list(arrays.values()))
    # safetensors refuses an empty tensor dict; keep one marker so empty caches save too
    arrays.setdefault("_mlxkv", mx.array([0]))
    mx.save_safetensors(
        str(path),
        arrays,
        {
            "mlxkv_cache": FORMAT,
            "metadata": json.dumps(metadata, sort_keys=True),
            "layers": json.dumps(layers),
        },
    )


def read_metadata(path) -> dict:
    """The caller metadata stored in a saved cache file."""
    _, meta = _load(path)
    return json.loads(meta["metadata"])


def _load(path):
    path = Path(path)
    if not path.exists():
        raise CacheError(f"no saved cache at {path}")
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:  # corrupt or not safetensors
        raise CacheError(f"{path} is not a readable cache file ({e})") from None
    if meta.get("mlxkv_cache") != FORMAT:
        raise CacheError(f"{path} is not an mlxkv cache file (format {FORMAT})")
    return arrays, meta


def load_caches(path, expect_metadata: dict) -> list:
    """Load caches saved by :func:`save_caches`, refusing them unless every key of
    ``expect_metadata`` (e.g. model, policy, dtype) matches what was saved."""
    arrays, meta = _load(path)
    saved = json.loads(meta["metadata"])
    for key, want in expect_metadata.items():
        have = saved.get(key)
        if json.dumps(have, sort_keys=True) != json.dumps(want, sort_keys=True):
            raise CacheError(
                f"saved cache {Path(path).name} was made with {key}={json.dumps(have)}, "
                f"this session has {key}={json.dumps(want)}"
            )
    layers = json.loads(meta["layers"])
    return [_restore(i, rec, arrays) for i, rec in enumerate(layers)]
