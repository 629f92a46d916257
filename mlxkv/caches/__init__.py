"""KV cache policies implementing mlx-lm's cache protocol.

Entry points: :func:`make_caches` / :func:`check_policy` (apply a ``KVPolicy`` to any
mlx-lm model), :func:`trim_caches` (rewind), :func:`save_caches` / :func:`load_caches`.
Every cache built here exposes ``kept`` / ``evicted`` / ``tokens_seen`` (plain ints) and
``nbytes``, which ``mlxkv.memory.policy_bytes.allocated_bytes`` predicts exactly.
"""

from mlxkv.caches.build import PolicyPlan, cache_for, check_policy, make_caches, plan_policy
from mlxkv.caches.errors import CacheError
from mlxkv.caches.full import FullKVCache
from mlxkv.caches.kivi import KiviKVCache
from mlxkv.caches.persist import load_caches, read_metadata, register_with_mlx_lm, save_caches
from mlxkv.caches.snapshot import always_exact, copy_caches, restore, snapshot
from mlxkv.caches.streaming import QuantizedStreamingKVCache, StreamingKVCache, prefill_chunk
from mlxkv.caches.trim import trim_caches, trimmable, trimmable_after

__all__ = [
    "CacheError",
    "always_exact",
    "FullKVCache",
    "KiviKVCache",
    "PolicyPlan",
    "QuantizedStreamingKVCache",
    "StreamingKVCache",
    "cache_for",
    "check_policy",
    "copy_caches",
    "load_caches",
    "make_caches",
    "plan_policy",
    "prefill_chunk",
    "read_metadata",
    "restore",
    "save_caches",
    "snapshot",
    "trim_caches",
    "trimmable",
    "trimmable_after",
]

# mlx-lm's load_prompt_cache finds cache classes by name in its own module.
register_with_mlx_lm()
