"""The cache configurations compared: mlxkv policies and the closest mlx-lm setting of each.

Every bounded cache keeps the same K tokens (equal memory): window K; sinks S + window
K - S. mlx-lm has no sink-aware window and cannot quantize a rotating cache, so:
window K -> RotatingKVCache(K, keep=0); sinks + window -> RotatingKVCache(K, keep=S);
b-bit -> QuantizedKVCache(group 64, b); sinks + b-bit has no mlx-lm form and is compared
with RotatingKVCache(K, keep=S).

mlx-lm's RotatingKVCache hides its sink slots from multi-token chunks, so a chunked stream
through it shows what a long *prompt* gets. What a long *generated* chat gets (token by
token) is ``lm-rot-decode``: an exact chunked emulation of its decode
semantics from ``mlxkv/bench/long_ppl.py`` (sinks never re-positioned; quality only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mlxkv.policy import KVPolicy


@dataclass(frozen=True)
class CacheConfig:
    key: str  # short id used in tables and JSON
    label: str
    side: str  # "mlxkv" | "mlx-lm"
    policy: KVPolicy | None  # the mlxkv policy (None for mlx-lm)
    bounded: bool  # keeps a bounded number of tokens
    peer: str | None = None  # key of the mlx-lm config this one is compared with
    # ("full",) | ("rotating", size, keep) | ("quantized", bits) | ("rotating-decode", k, s)
    mlx_lm: tuple | None = None

    def factory(self, model) -> Callable[[], list]:
        if self.side == "mlxkv":
            from mlxkv.caches import make_caches

            return lambda: make_caches(model, self.policy)
        from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache, make_prompt_cache

        kind = self.mlx_lm[0]
        n = len(model.layers)
        if kind == "full":
            return lambda: make_prompt_cache(model)
        if kind == "rotating":
            size, keep = self.mlx_lm[1:]
            return lambda: [RotatingKVCache(size, keep=keep) for _ in range(n)]
        if kind == "rotating-decode":
            from mlxkv.bench.long_ppl import build_caches

            kept, sinks = self.mlx_lm[1:]
            return lambda: build_caches(model, "rotating", kept - sinks, sinks)
        bits = self.mlx_lm[1]
        return lambda: [QuantizedKVCache(group_size=64, bits=bits) for _ in range(n)]


def all_configs(kept: int, sinks: int) -> dict[str, CacheConfig]:
    k, s = kept, sinks
    w = k - s  # the window beside the sinks
    cfgs = [
        CacheConfig("full", "full", "mlxkv", KVPolicy(), False, "lm-full"),
        CacheConfig("window", f"window {k}", "mlxkv", KVPolicy(window=k), True, "lm-rot0"),
        CacheConfig(
            "sink-window",
            f"sink {s} + window {w}",
            "mlxkv",
            KVPolicy(window=w, sinks=s),
            True,
            "lm-rot",
        ),  # fmt: skip
        CacheConfig("8bit", "8-bit", "mlxkv", KVPolicy(bits=8), False, "lm-q8"),
        CacheConfig("4bit", "4-bit", "mlxkv", KVPolicy(bits=4), False, "lm-q4"),
        # keys grouped per token, as mlx-lm's: their product is transpose=True, the form
        # MLX's fast CUDA quantized kernels take (KIVI's per-channel keys take the naive one)
        CacheConfig(
            "4bit-plain",
            "4-bit, plain keys",
            "mlxkv",
            KVPolicy(bits=4, key_scheme="plain"),
            False,
            "lm-q4",
        ),  # fmt: skip
        CacheConfig(
            "sink-4bit",
            f"sink {s} + window {w}, 4-bit",
            "mlxkv",
            KVPolicy(window=w, sinks=s, bits=4),
            True,
            "lm-rot",
        ),  # fmt: skip
        CacheConfig("lm-full", "KVCache", "mlx-lm", None, False, mlx_lm=("full",)),
        CacheConfig(
            "lm-rot0",
            f"RotatingKVCache({k}, keep=0)",
            "mlx-lm",
            None,
            True,
            mlx_lm=("rotating", k, 0),
        ),  # fmt: skip
        CacheConfig(
            "lm-rot",
            f"RotatingKVCache({w + s}, keep={s})",
            "mlx-lm",
            None,
            True,
            mlx_lm=("rotating", w + s, s),
        ),  # fmt: skip
        CacheConfig(
            "lm-rot-decode",
            f"RotatingKVCache({k}, keep={s}), token by token",
            "mlx-lm",
            None,
            True,
            mlx_lm=("rotating-decode", k, s),
        ),  # fmt: skip
        CacheConfig("lm-q8", "QuantizedKVCache(8)", "mlx-lm", None, False, mlx_lm=("quantized", 8)),
        CacheConfig("lm-q4", "QuantizedKVCache(4)", "mlx-lm", None, False, mlx_lm=("quantized", 4)),
    ]
    return {c.key: c for c in cfgs}
