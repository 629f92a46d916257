"""Live KV accounting: what the caches hold next to what the memory model predicts.

Per token this costs one predictor step (O(distinct cache kinds)) and a sum of nbytes
over the layers, which reads array shapes only: no device sync.
"""

from __future__ import annotations

from dataclasses import replace

from mlxkv.engine.events import Stats
from mlxkv.policy import KVPolicy


class KVAccounting:
    def __init__(self, loaded, policy: KVPolicy, caches: list):
        from mlxkv.memory import layout_for
        from mlxkv.memory.predictor import KVPredictor

        self.caches = caches
        self.loaded = loaded
        if getattr(loaded, "layout", None) is None:
            loaded.layout = layout_for(loaded.config)  # once per model, not per cache
        self.predictor = KVPredictor(loaded.layout, policy, 1, loaded.dtype)
        self.last = self.predictor.snapshot()

    def advance(self, n: int, chunk: int | None = None) -> None:
        """``n`` tokens went through the model in one call."""
        self.last = self.predictor.advance(n)

    def actual_bytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def snapshot(self, stats: Stats) -> Stats:
        import mlx.core as mx

        p = self.last
        return replace(
            stats,
            kv_tokens=p.kept_tokens,
            kv_evicted=p.evicted_tokens,
            kv_tokens_seen=p.tokens_seen,
            kv_bytes_actual=self.actual_bytes(),
            kv_bytes_predicted=p.allocated,
            kv_bytes_logical=p.logical,
            active_memory=mx.get_active_memory(),
            peak_memory=mx.get_peak_memory(),
            weights_bytes=self.loaded.weights_bytes,
        )
