"""KV statistics read from the caches, beside the memory model's prediction for them.

``kept``, ``evicted``, ``tokens_seen`` and ``nbytes`` come from the caches themselves (plain
ints and array shapes: no device sync). The memory model is not advanced in step with the
engine: each reading brings a predictor to the caches' token count (forward by the tokens
fed since the last reading; rebuilt when a trim or a restore went back), so a prediction
that drifts from what MLX holds shows up as ``kv_bytes_predicted != kv_bytes_actual``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mlxkv.engine.events import Stats
from mlxkv.policy import KVPolicy


@dataclass(frozen=True)
class KVReading:
    tokens_seen: int  # tokens the caches hold a trace of (kept + evicted)
    kept: int
    evicted: int
    nbytes: int


def read_caches(caches: list) -> KVReading:
    """What the caches say they hold. Layers a policy governs expose ``kept`` /
    ``evicted`` / ``tokens_seen``; the model's own caches only ``offset`` or ``size()``."""
    ours = [c for c in caches if hasattr(c, "tokens_seen")]
    if ours:
        seen = max(c.tokens_seen for c in ours)
        kept = max(c.kept for c in ours)
        evicted = max(c.evicted for c in ours)
    else:
        seen = max((c.offset for c in caches if hasattr(c, "offset")), default=0)
        kept = max((c.size() for c in caches), default=0)
        evicted = max(seen - kept, 0)
    return KVReading(seen, kept, evicted, sum(c.nbytes for c in caches))


class KVAccounting:
    def __init__(self, loaded, policy: KVPolicy, caches: list):
        self.caches = caches
        self.loaded = loaded
        self.policy = policy
        self._predictor = self._new_predictor()
        self.last = self._predictor.snapshot()

    def _new_predictor(self):
        from mlxkv.memory.predictor import KVPredictor

        return KVPredictor(self.loaded.kv_layout, self.policy, 1, self.loaded.dtype)

    def read(self) -> KVReading:
        return read_caches(self.caches)

    def predicted(self, tokens_seen: int):
        """The memory model's figures for ``tokens_seen`` tokens (moved there lazily)."""
        p = self._predictor
        if tokens_seen < p.tokens_seen:  # a trim or a restore went back: start again
            p = self._predictor = self._new_predictor()
            self.last = p.snapshot()
        if tokens_seen > p.tokens_seen:
            self.last = p.advance(tokens_seen - p.tokens_seen)
        return self.last

    def actual_bytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def snapshot(self, stats: Stats) -> Stats:
        import mlx.core as mx

        now = self.read()
        p = self.predicted(now.tokens_seen)
        return replace(
            stats,
            kv_tokens=now.kept,
            kv_evicted=now.evicted,
            kv_tokens_seen=now.tokens_seen,
            kv_bytes_actual=now.nbytes,
            kv_bytes_predicted=p.allocated,
            kv_bytes_logical=p.logical,
            active_memory=mx.get_active_memory(),
            peak_memory=mx.get_peak_memory(),
            weights_bytes=self.loaded.weights_bytes,
        )
