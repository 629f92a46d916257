"""Memory besides weights and KV: prefill activations, logits, allocator overhead.

These are ESTIMATES (labelled so in every output): MLX frees intermediates as soon as the
graph no longer needs them, so the peak is about one layer's working set for one prefill
chunk, plus the logits of the step that samples.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxkv.memory.dtypes import dtype_bytes
from mlxkv.memory.layout import Layout

BASE_OVERHEAD = 400 * 10**6  # Python, MLX, mlx-lm, tokenizer, Metal/BLAS buffers
OVERHEAD_FRACTION = 0.05  # allocator rounding and MLX's buffer cache on top of live data


@dataclass(frozen=True)
class Runtime:
    activation_bytes: int  # one prefill chunk through one layer (estimate)
    logits_bytes: int  # float32 logits + log-probs of the sampling step (estimate)
    overhead_bytes: int  # fixed runtime + allocator slack (estimate)


def _attention_span(layout: Layout, context: int, window: int | None) -> tuple[int, int]:
    """(query heads, longest key span) an attention layer sees at ``context`` tokens."""
    heads = layout.facts.num_attention_heads or max((p.kv_heads for p in layout.specs()), default=0)
    span = 0
    for p in layout.specs():
        if p.cls in ("KVCache", "QuantizedKVCache"):
            span = max(span, context if (window is None or not p.grows) else min(context, window))
        elif p.cls in ("RotatingKVCache", "ChunkedKVCache"):
            span = max(span, min(context, p.window or context))
    return heads, span


def estimate(
    layout: Layout,
    context: int,
    batch: int,
    chunk: int,
    act_dtype: str,
    weights_bytes: int,
    kv_bytes: int,
    on: str,
    window: int | None = None,
) -> Runtime:
    f = layout.facts
    b = dtype_bytes(act_dtype)
    n = batch * min(chunk, max(context, 1))
    hidden, inter = f.hidden_size, f.intermediate_size or 4 * f.hidden_size
    # Residual stream, normed input, attention output, q/k/v, MLP gate/up/product.
    act = n * b * (6 * hidden + 3 * inter)
    heads, span = _attention_span(layout, context, window)
    if on == "cpu":  # no fused attention kernel: scores are materialized in float32
        act += n * heads * span * 4
    logits = batch * f.vocab_size * 4 * 2
    overhead = BASE_OVERHEAD + int(OVERHEAD_FRACTION * (weights_bytes + kv_bytes))
    return Runtime(act, logits, overhead)
