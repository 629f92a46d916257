"""Save / load per-layer caches in mlx-lm's prompt-cache format, and check a file first.

Every cache's ``state`` carries its arrays and scalars (mlx-lm 0.32.2's format), so a file
written here loads with plain mlx-lm too once ``mlxkv.caches`` is imported (which makes
mlx-lm's loader find mlxkv's class names). The file's string metadata adds ``mlxkv_cache``
(format version) and ``metadata`` (the caller's dict as JSON: model identity, policy,
dtype, token ids, ...). A cache that has not evicted keeps only the slots of its tokens in
the file and gets its whole 256-slot step back when read.

A cache file is input like any other: anyone may have edited it, and MLX trusts what it
reads (an offset past a buffer's end writes out of bounds). :func:`load_caches` therefore
reads the safetensors header itself and checks everything before MLX sees the file: the
header's JSON, every tensor's dtype, shape and byte range, the metadata, the data against
the digest written with it (damage the layout checks cannot see), and each layer's
state against ``reference`` (caches of this model and policy that have seen one token):
the same class, the same policy scalars, arrays of the same dtype, heads and head size,
counters that agree with each other and with the buffers that hold them. Writes go through
:func:`mlxkv.files.atomic_file` (no planted link followed, a read-only file refused).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_cache

from mlxkv.caches.errors import CacheError
from mlxkv.caches.full import FullKVCache
from mlxkv.caches.kivi import KiviKVCache
from mlxkv.caches.streaming import QuantizedStreamingKVCache, StreamingKVCache
from mlxkv.errors import UserError, first_line
from mlxkv.files import atomic_write_with, open_regular, parse_json, shared_bytes
from mlxkv.memory.policy_bytes import capacity, kivi_ring_slots, round_up

FORMAT = "3"  # 3: with the digest of the data
MLXKV_CLASSES = (FullKVCache, StreamingKVCache, QuantizedStreamingKVCache, KiviKVCache)
# mlx-lm's own caches a model may keep for layers a policy leaves alone
MLX_LM_CLASSES = ("KVCache", "RotatingKVCache", "ArraysCache")
HEADER_LIMIT = 256 << 20  # bytes of safetensors JSON header (30M token ids fit)
MAX_TOKENS = 1 << 31  # no counter in a cache file can be larger
_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
           "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}  # fmt: skip
_TENSOR_NAME = re.compile(r"^\d{1,6}(\.[A-Za-z_0-9]{1,40}){0,4}$")
_POLICY_KEYS = ("window", "sinks", "rebase_every", "rotation", "key_bits",
                "key_group_size", "key_scheme", "value_bits", "value_group_size", "bits",
                "group_size", "keep", "max_size")  # fmt: skip
_COUNTERS = ("tokens_seen", "evicted", "base", "sink_shift")
# An undo log's length is the writer's choice (drafts on or off), not what the cache holds:
# any from none to this many tokens reads.
MAX_RESERVE = 128


def register_with_mlx_lm() -> None:
    """mlx-lm's ``load_prompt_cache`` resolves a saved class by its name in
    ``mlx_lm.models.cache``: add mlxkv's cache classes there (no mlx-lm name is replaced)."""
    for cls in MLXKV_CLASSES:
        if getattr(mlx_cache, cls.__name__, cls) is not cls:
            raise CacheError(f"mlx-lm already defines a cache named {cls.__name__}")
        setattr(mlx_cache, cls.__name__, cls)


def _stored(c):
    """What a file keeps of a cache: of an mlxkv cache that has not evicted, the slots of
    its tokens, not the rest of its 256-slot step (a 39-token conversation of the default
    model: 1.8 MB, not 11.8 MB)."""
    if not hasattr(c, "stored_state"):
        return c
    d = copy.copy(c)
    d.state = c.stored_state()
    return d


def save_caches(path, caches: list, metadata: dict) -> None:
    """Write ``caches`` and ``metadata`` (JSON-able dict) to ``path`` (.safetensors),
    atomically (:func:`mlxkv.files.atomic_file`)."""
    register_with_mlx_lm()
    path = Path(path)
    caches = [_stored(c) for c in caches]
    for c in caches:
        if type(c).__name__ not in {k.__name__ for k in MLXKV_CLASSES} and not hasattr(
            mlx_cache, type(c).__name__
        ):
            raise CacheError(f"cannot save a cache of unknown class {type(c).__name__}")
    header = {
        "mlxkv_cache": FORMAT,
        "metadata": json.dumps(metadata, sort_keys=True),
        # the arrays of the states (mlx-lm writes their scalars as arrays too: not these)
        "digest": data_digest(
            {k: v for k, v in tree_flatten([c.state for c in caches]) if isinstance(v, mx.array)}
        ),
    }
    atomic_write_with(
        path, lambda f: mlx_cache.save_prompt_cache(f, caches, header), what="cache file"
    )


def data_digest(arrays: dict) -> str:
    """SHA-256 of every tensor's name, dtype, shape and bytes, in name order: what a file's
    data must hash to when it is read back (about 1 GB/s)."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = mx.contiguous(arrays[name])
        mx.eval(a)
        h.update(f"{name} {a.dtype} {list(a.shape)}\n".encode())
        if a.size:
            h.update(memoryview(a).cast("B"))
    return h.hexdigest()


# -- reading: the header, checked before MLX reads anything ---------------------------------


def _bad(path, why: str) -> CacheError:
    return CacheError(f"{Path(path).name} is not a readable cache file ({why}); delete it")


def _format_error(path, found) -> CacheError:
    if found in ("1", "2"):
        return CacheError(
            f"{Path(path).name} was saved by an older mlxkv (cache format {found}; this one "
            f"reads {FORMAT}); delete it, and the next run saves it again"
        )
    return CacheError(f"{path} is not an mlxkv cache file (format {FORMAT})")


def _read_header(f, size: int, path) -> tuple[dict, dict]:
    """The tensor table and the string metadata of a safetensors file, every entry
    checked: dtypes MLX knows, shapes of small non-negative ints, byte ranges that fit the
    data, match the shape and share no bytes (a small file naming its data many times
    would load as gigabytes)."""
    head = f.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 2 <= n <= min(HEADER_LIMIT, size - 8):
        raise _bad(path, "not a safetensors file")
    try:
        text = f.read(n).decode("utf-8")
        table = parse_json(text, "its header", max_depth=4)
    except (UnicodeDecodeError, UserError) as e:
        raise _bad(path, f"header: {e}") from None
    if not isinstance(table, dict):
        raise _bad(path, "header is not an object")
    meta = table.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise _bad(path, "metadata is not a table of strings")
    if meta.get("0.mlxkv_cache") != FORMAT:
        raise _format_error(path, meta.get("0.mlxkv_cache"))
    data = size - 8 - n
    for name, t in table.items():
        ok = (
            isinstance(t, dict)
            and _TENSOR_NAME.match(name)
            and t.get("dtype") in _DTYPES
            and isinstance(t.get("shape"), list)
            and len(t["shape"]) <= 6
            and all(type(d) is int and 0 <= d < MAX_TOKENS for d in t["shape"])
            and isinstance(t.get("data_offsets"), list)
            and len(t["data_offsets"]) == 2
            and all(type(o) is int for o in t["data_offsets"])
        )
        if not ok:
            raise _bad(path, f"tensor {name[:60]!r} is malformed")
        count = 1
        for d in t["shape"]:
            count *= d
        a, b = t["data_offsets"]
        if not 0 <= a <= b <= data or b - a != count * _DTYPES[t["dtype"]]:
            raise _bad(path, f"tensor {name} does not fit the file")
    if shared_bytes({name: tuple(t["data_offsets"]) for name, t in table.items()}):
        raise _bad(path, "two tensors share bytes")
    return table, meta


def _layout(meta: dict, path) -> tuple[dict, list[str], list[tuple[str, str]]]:
    """mlx-lm's flattened ``[metadata, classes, scalars]``: ours, the class per layer, and
    which tensors hold scalars."""
    ours = {k[2:]: v for k, v in meta.items() if k.startswith("0.")}
    if ours.get("mlxkv_cache") != FORMAT:
        raise _format_error(path, ours.get("mlxkv_cache"))
    try:
        caller = parse_json(ours.get("metadata", ""), "its metadata", max_depth=8, utf8=True)
    except UserError as e:
        raise _bad(path, str(e)) from None
    if not isinstance(caller, dict):
        raise _bad(path, "its metadata is not an object")
    classes = []
    while f"1.{len(classes)}" in meta:
        classes.append(meta[f"1.{len(classes)}"])
    scalars, j = [], 1
    while f"2.{j}.0" in meta:
        scalars.append((meta[f"2.{j}.0"], meta.get(f"2.{j}.1", "")))
        j += 1
    known = len(ours) + len(classes) + 2 * len(scalars) + 1
    if meta.get("2.0") != "" or known != len(meta) or not classes:
        raise _bad(path, "its layer table is malformed")
    return caller, classes, scalars


def _scalar(arrays: dict, name: str, kind: str, path):
    a = arrays.get(name)
    if a is None:
        raise _bad(path, f"scalar {name} is missing")
    if kind == "none" and a.size == 0:
        return None
    if kind == "scalar" and a.size == 1 and a.ndim == 0:
        return a.item()
    if kind == "string" and a.ndim == 1 and a.size <= 64 and a.dtype in (mx.int32, mx.int64):
        codes = a.tolist()
        if all(32 <= c < 127 for c in codes):
            return "".join(map(chr, codes))
    raise _bad(path, f"scalar {name} is not a {kind}")


def _open(path):
    if not Path(path).exists():
        raise CacheError(f"no saved cache at {path}")
    try:
        return open_regular(path, "cache file")
    except UserError as e:
        raise CacheError(str(e)) from None


def read_metadata(path) -> dict:
    """The caller metadata stored in a saved cache file (checked as by load_caches)."""
    f, size = _open(path)
    with f:
        _, meta = _read_header(f, size, path)
    return _layout(meta, path)[0]


def check_metadata(path, saved: dict, expect_metadata: dict) -> None:
    """Raise :class:`CacheError` (one line) unless ``saved`` matches ``expect_metadata``."""
    for key, want in expect_metadata.items():
        have = saved.get(key)
        if json.dumps(have, sort_keys=True) != json.dumps(want, sort_keys=True):
            if key == "model_id":
                raise CacheError(
                    f"saved cache {Path(path).name} was made for another model (its config, "
                    "weights or tokenizer differ); use it with that model, or delete it"
                )
            raise CacheError(
                f"saved cache {Path(path).name} was made with {key}={json.dumps(have)[:200]}, "
                f"this session has {key}={json.dumps(want)}"
            )


# -- each layer's state against a live cache of this model and policy -------------------------


def _is_int(v) -> bool:
    return type(v) is int and 0 <= v < MAX_TOKENS


def _tokens_axis(key: str) -> int:
    return 3 if key.startswith("ring") else 2  # KIVI keys are stored transposed


def _check_arrays(flat: dict, ref: dict, optional) -> None:
    """Every array of the reference is there (unless ``optional(key)``), with its dtype,
    rank and sizes (the token axis aside); no array the reference lacks."""
    for key, have in flat.items():
        want = ref.get(key)
        if not isinstance(have, mx.array):
            if isinstance(want, mx.array) or key not in ref:
                _need(have is None, f"{key} is {have!r}, not an array")
            continue
        if not isinstance(want, mx.array):
            raise ValueError(f"{key} is an array, not a field of this cache")
        if have.dtype != want.dtype or have.ndim != want.ndim:
            raise ValueError(f"{key} is {have.dtype} {list(have.shape)}, not {want.dtype}")
        axis = _tokens_axis(key) if have.ndim == 4 else None
        for d in range(have.ndim):
            if d != axis and have.shape[d] != want.shape[d]:
                raise ValueError(
                    f"{key} has shape {list(have.shape)}; this model needs {list(want.shape)}"
                )
    for key, want in ref.items():
        if isinstance(want, mx.array) and flat.get(key) is None and not optional(key):
            raise ValueError(f"{key} is missing")


def _need(cond: bool, why: str) -> None:
    if not cond:
        raise ValueError(why)


def _tokens(x) -> int:
    """Slots of a buffer; the parts of a packed one must have as many (a crafted file's
    would be written past their ends)."""
    parts = x if isinstance(x, (list, tuple)) else [x]
    _need(len({p.shape[2] for p in parts}) == 1, "the parts of a packed buffer disagree")
    return parts[0].shape[2]


def _check_state(name: str, state, ref_state) -> int:
    """Check one layer's state; returns the tokens it has seen. ValueError says why."""
    flat, ref = dict(tree_flatten(state)), dict(tree_flatten(ref_state))
    if isinstance(ref_state, dict):
        _need(isinstance(state, dict) and set(state) == set(ref_state), "wrong fields")
        for key in _POLICY_KEYS:
            if key in ref_state and key != "rotation":
                _need(state[key] == ref_state[key] and type(state[key]) is type(ref_state[key]),
                      f"{key} is {state[key]!r}, this policy has {ref_state[key]!r}")  # fmt: skip
        if "rotation" in ref_state:
            _need(state["rotation"] == ref_state["rotation"], "its rotation is another model's")
        if "reserve" in ref_state:
            r = state["reserve"]
            _need(_is_int(r) and 0 <= r <= MAX_RESERVE, f"reserve is {r!r}")
        for key in _COUNTERS:
            if key in ref_state:
                v = state[key]
                _need(_is_int(v) or (key == "sink_shift" and v is None), f"{key} is {v!r}")
        n, e, base = state["tokens_seen"], state["evicted"], state["base"]
        _need(e <= n and base <= n and (state.get("sink_shift") or 0) <= n,
              "its counters disagree")  # fmt: skip
        S, W = state["sinks"], state["window"]
        early = ("ring", "residual") if name == "KiviKVCache" and n <= S else ()
        _check_arrays(flat, ref, lambda k: n == 0 or k.split(".")[0] in early)
        kept = n - e
        if W is None:
            _need(e == 0, "a full cache evicted tokens")
        else:
            _need(kept <= S + W, f"it keeps {kept} tokens, more than {S + W}")
        if n == 0:
            return 0
        if name == "KiviKVCache":
            G = state["key_group_size"]
            ring = kivi_ring_slots(n, S, W, G)
            if not e:  # a file keeps the groups in use and the values of the tokens
                ring = round_up(n - S, G) if n > S else 0
            _need(state["values"] is not None, "no buffers")
            if state["residual"] is not None:
                rows = state["residual"].shape[2]  # a file keeps the rows in use, 1 or more
                _need(max(n - S, 0) % G <= rows <= G and rows,
                      "its residual group has the wrong size")  # fmt: skip
            if ring:
                _need(state["ring"] is not None and state["ring"][1].shape[3] * G >= ring,
                      "its key ring is smaller than its counters say")  # fmt: skip
            _need(_tokens(state["values"]) >= (min(n, S) + ring if e else n),
                  "its values are fewer than its counters say")  # fmt: skip
        else:
            # before an eviction a file keeps the slots of the tokens, after it the ring
            held = capacity(n, S + W) if e else n
            _need(state["keys"] is not None and state["values"] is not None, "no buffers")
            _need(_tokens(state["keys"]) >= held and _tokens(state["values"]) >= held,
                  "its buffers are smaller than its counters say")  # fmt: skip
        if S:
            _need(state["sink_keys"] is not None and state["sink_keys"].shape[2] == S,
                  "its sink keys do not match its sinks")  # fmt: skip
        return n
    _need(isinstance(state, (list, tuple)) and len(state) == len(ref_state), "wrong fields")
    if name in ("FullKVCache", "KVCache"):
        keys, values, offset = state
        _need(_is_int(offset), f"offset is {offset!r}")
        _check_arrays(flat, ref, lambda k: offset == 0)
        if offset:
            _need(keys.shape[2] >= offset and values.shape[2] >= offset,
                  f"offset {offset} is past the end of its buffers")  # fmt: skip
        return offset
    if name == "RotatingKVCache":
        keys, values, offset, keep, max_size, idx = state
        _need((keep, max_size) == tuple(ref_state[3:5]), "its window is not this policy's")
        _need(all(map(_is_int, (offset, idx))), "its counters are not counts")
        _check_arrays(flat, ref, lambda k: offset == 0)
        if offset:
            _need(idx <= keys.shape[2] <= max_size and keys.shape == values.shape,
                  "its counters disagree with its buffers")  # fmt: skip
        return offset
    # ArraysCache (SSM states): fixed sizes, exactly those of this model
    _check_arrays(flat, ref, lambda k: False)
    _need(all(flat[k].shape == v.shape for k, v in ref.items() if isinstance(v, mx.array)),
          "its state has another shape")  # fmt: skip
    return -1  # an SSM state counts no tokens


def reference_caches(model, policy) -> tuple[list, int]:
    """Caches of ``model`` under ``policy`` after a few tokens, past the sinks so that every
    buffer exists (what a file must look like), and the model's vocabulary size."""
    from mlxkv.caches.build import make_caches

    refs = make_caches(model, policy)
    logits = model(mx.zeros((1, policy.sinks + 2), dtype=mx.int32), cache=refs)
    mx.eval(logits, [c.state for c in refs])
    return refs, logits.shape[-1]


def load_caches(path, expect_metadata: dict) -> list:
    """Load caches saved by :func:`save_caches`, refusing them unless every key of
    ``expect_metadata`` (e.g. model, policy, dtype) matches what was saved."""
    return load_checked(path, expect_metadata)[0]


def load_checked(path, expect_metadata: dict, reference: list | None = None):
    """Caches saved by :func:`save_caches`, refused (one line) unless every key of
    ``expect_metadata`` matches what was saved and, with ``reference`` (see
    :func:`reference_caches`), every layer's state fits this model and policy.

    Returns ``(caches, metadata, tokens_seen)``: the caches in file order, the caller's
    metadata, and the tokens each cache has seen (-1 for a state that counts none)."""
    register_with_mlx_lm()
    f, size = _open(path)
    with f:
        table, meta = _read_header(f, size, path)
        caller, classes, scalars = _layout(meta, path)
        digest = meta.get("0.digest")
        if not isinstance(digest, str):
            raise _bad(path, "it has no digest of its data")
        check_metadata(path, caller, expect_metadata)
        allowed = {c.__name__ for c in MLXKV_CLASSES} | set(MLX_LM_CLASSES)
        for c in classes:
            if c not in allowed:
                raise _bad(path, f"unknown cache class {c[:40]!r}")
        for name in table:
            if int(name.split(".")[0]) >= len(classes):
                raise _bad(path, f"tensor {name} belongs to no layer")
        f.seek(0)
        try:
            arrays = mx.load(f, format="safetensors")
        except Exception as e:  # checked above; anything left is MLX's one line
            raise _bad(path, first_line(e)) from None
    scalar_names = {pos for pos, _ in scalars}  # arrays mlx-lm made of scalars: not hashed
    if data_digest({k: v for k, v in arrays.items() if k not in scalar_names}) != digest:
        raise _bad(path, "its data is damaged: it does not match the digest written with it")
    for pos, kind in scalars:
        arrays[pos] = _scalar(arrays, pos, kind, path)
    try:
        states = tree_unflatten(list(arrays.items()))
    except Exception:
        raise _bad(path, "its arrays do not form layers") from None
    if not isinstance(states, list) or len(states) != len(classes):
        raise _bad(path, "its arrays do not form layers")
    caches, seen = [], []
    for i, (name, state) in enumerate(zip(classes, states, strict=True)):
        if reference is not None:
            ref = reference[i % len(reference)]
            if name != type(ref).__name__:
                raise _bad(path, f"layer {i} holds a {name}, this policy makes a "
                           f"{type(ref).__name__}")  # fmt: skip
            try:
                seen.append(_check_state(name, state, ref.state))
            except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
                raise _bad(path, f"layer {i}: {e}") from None
        try:
            caches.append(getattr(mlx_cache, name).from_state(state))
        except Exception as e:
            raise _bad(path, f"layer {i}: {type(e).__name__}") from None
    return caches, caller, seen


def _token_ids(value, vocab: int, what: str, path) -> list[int]:
    if not isinstance(value, list) or not all(type(t) is int and 0 <= t < vocab for t in value):
        raise _bad(path, f"its {what} are not token ids of this model (0 to {vocab - 1})")
    return value


def load_session(path, expect_metadata: dict, model, policy):
    """A session's saved caches (see ``Session.save_cache``), everything checked:
    the layers (``layers`` and the turn-boundary copy after them), the token ids (ids of
    this vocabulary, exactly as many as every cache has seen).

    Returns ``(caches, tokens, checkpoint)``; ``checkpoint`` is None or
    ``(checkpoint_caches, checkpoint_tokens)``."""
    reference, vocab = reference_caches(model, policy)
    caches, meta, seen = load_checked(path, expect_metadata, reference)
    n = meta.get("layers")
    if n != len(reference) or len(caches) not in (n, 2 * n):
        raise _bad(path, f"it holds {len(caches)} caches for layers={n!r}; this model has "
                   f"{len(reference)} layers")  # fmt: skip
    tokens = _token_ids(meta.get("tokens"), vocab, "tokens", path)
    if any(s not in (-1, len(tokens)) for s in seen[:n]):
        raise _bad(path, f"it lists {len(tokens)} tokens, its caches hold {max(seen[:n])}")
    has_cp = "checkpoint_tokens" in meta
    if has_cp != (len(caches) == 2 * n):
        raise _bad(path, "its turn-boundary copy does not match its layers")
    if not has_cp:
        return caches, tokens, None
    cp_tokens = _token_ids(meta["checkpoint_tokens"], vocab, "checkpoint tokens", path)
    if any(s not in (-1, len(cp_tokens)) for s in seen[n:]):
        raise _bad(path, "its turn-boundary copy holds another number of tokens than it lists")
    return caches[:n], tokens, (caches[n:], cp_tokens)
