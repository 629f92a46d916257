"""Prediction: the memory model's KV bytes (from config.json alone) against what the
caches actually hold, and weights + predicted KV against the measured peaks.

The predictor is told the same prefill chunking the stream used, because allocation
(256-token steps, rotating buffers growing during a chunk) depends on it.
"""

from __future__ import annotations

from mlxkv.bench.configs import CacheConfig
from mlxkv.bench.stream import StreamResult


def compare(loaded, configs: dict[str, CacheConfig], streams: dict[str, StreamResult], chunk):
    from mlxkv.memory.predictor import predict
    from mlxkv.memory.probe import probe

    layout = loaded.layout or probe(loaded.config)
    rows = []
    for key, r in streams.items():
        cfg = configs[key]
        if cfg.policy is None:
            continue  # mlx-lm's own caches: not a policy the predictor is asked about
        for cp in r.checkpoints:
            p = predict(layout, cp.tokens, cfg.policy, kv_dtype=loaded.dtype, chunk=chunk)
            floor = loaded.weights_bytes + p.peak_allocated
            rows.append(
                {
                    "config": key,
                    "tokens": cp.tokens,
                    "kv_predicted": p.allocated,
                    "kv_actual": cp.kv_bytes,
                    "kv_logical": p.logical,
                    "kv_error": (p.allocated - cp.kv_bytes) / cp.kv_bytes if cp.kv_bytes else 0,
                    "weights_plus_kv": floor,
                    "mlx_peak": cp.mlx_peak,
                    "process_peak": cp.process_peak,
                    "mlx_peak_over_floor": cp.mlx_peak / floor,
                }
            )
    return rows
