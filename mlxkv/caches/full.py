"""Full (unbounded, unquantized) KV cache: mlx-lm's ``KVCache`` with predictable allocation.

mlx-lm's ``KVCache`` grows by ``ceil(N / 256) * 256`` slots after cutting the buffer back
to the tokens held, so its allocation depends on the history of chunk sizes. Ours always
holds ``round_up(tokens, 256)`` slots, so ``mlxkv.memory.policy_bytes`` predicts it exactly
from the token count. Everything else (mask, merge into ``BatchKVCache``) is mlx-lm's.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlxkv.caches import storage as st
from mlxkv.caches.rows import pad_tokens


class FullKVCache(KVCache):
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        prev = self.offset
        new = prev + keys.shape[2]
        cap = st.round_up(new)
        if self.keys is None:
            self.keys = mx.zeros((*keys.shape[:2], cap, keys.shape[3]), keys.dtype)
            self.values = mx.zeros((*values.shape[:2], cap, values.shape[3]), values.dtype)
        elif self.keys.shape[2] < cap:  # checked here: this runs per token and layer
            self.keys, self.values = pad_tokens(self.keys, cap), pad_tokens(self.values, cap)
        self.keys[..., prev:new, :] = keys
        self.values[..., prev:new, :] = values
        self.offset = new
        return self.keys_and_values()

    def stored_state(self):
        """What a file keeps: the slots of the tokens, not the rest of the 256-slot step."""
        if self.keys is None or self.keys.shape[2] == self.offset:
            return self.state
        n = self.offset
        return self.keys[..., :n, :], self.values[..., :n, :], n

    @classmethod
    def from_state(cls, state):
        """A cache from a file's state (which keeps only the slots of its tokens) with its
        whole step back: what the memory model counts, and where the next tokens go."""
        cache = super().from_state(state)
        if cache.keys is not None:
            cap = st.round_up(cache.offset)
            cache.keys, cache.values = pad_tokens(cache.keys, cap), pad_tokens(cache.values, cap)
        return cache

    @property
    def tokens_seen(self) -> int:
        return self.offset

    @property
    def kept(self) -> int:
        return self.offset

    @property
    def evicted(self) -> int:
        return 0

    def trimmable(self) -> int:
        return self.offset

    def trimmable_after(self, n: int) -> int:
        return self.offset + n

    def trim(self, n: int) -> int:
        n = super().trim(n)
        if self.offset == 0:
            self.keys = self.values = None
        elif self.keys.shape[2] > st.round_up(self.offset):
            self.keys = st.shrink(self.keys, st.round_up(self.offset))
            self.values = st.shrink(self.values, st.round_up(self.offset))
        return n

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """A quantized full cache holding the same tokens (mlx-lm's ``maybe_quantize_kv_cache``
        calls this; ours keeps the mlxkv allocation and counters)."""
        from mlxkv.caches.streaming import QuantizedStreamingKVCache

        q = QuantizedStreamingKVCache(None, bits=bits, group_size=group_size)
        if self.keys is not None:
            k, v = self.keys_and_values()
            q.update_and_fetch(k, v)
            q._dense = False  # the next call is the model's; no dense output is pending
        return q
