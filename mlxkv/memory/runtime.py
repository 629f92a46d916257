"""Memory besides weights and KV: prefill activations, logits, allocator overhead.

These are ESTIMATES (labelled so in every output): MLX frees intermediates as soon as the
graph no longer needs them, so the peak is about one layer's working set for one prefill
chunk, plus the logits of the step that samples.

Attention scores: mlx-lm calls ``mx.fast.scaled_dot_product_attention`` unless the cache
has ``bits`` (then ``quantized_scaled_dot_product_attention``, plain matmuls and a softmax
that hold the whole score matrix). mlxkv's quantized caches hide ``bits`` during a prefill
chunk and return dequantized keys/values (mlxkv/caches/streaming.py), so a prefill takes
the fast call and holds one layer's dequantized span instead; mlx-lm's own
QuantizedKVCache (built by a few models) does not.

On Metal the fast call runs a fused kernel that never materializes the scores when
``has_fused_kernel`` allows it and ``use_fallback`` does not decline it
(mlx/backend/metal/scaled_dot_product_attention.cpp, MLX commit 846d176):
for a prefill chunk (query length > 8) equal query/value head dims in {64, 72, 80, 96,
128} (192 and 256 have a kernel but the unfused path is chosen as faster, except 256 on
NAX hardware past 1,024 queries); for decoding (query length <= 8) equal head dims in {64,
96, 128, 256}, or 192/128. Everywhere else, and on the CPU backend (no fused kernel at
all: "the fused kernels require a GPU (Metal) stream"), MLX's fallback computes
``softmax(q @ k.T)`` and holds chunk x heads x span scores in the activation dtype.

On CUDA (``mlx-cuda``) a prefill chunk goes to cuDNN's fused attention when
``supports_sdpa_cudnn`` allows it (mlx/backend/cuda/scaled_dot_product_attention.cpp):
a GPU of compute capability 8 or more (Ampere, Hopper), float16/bfloat16 activations, and
query/value head dims that are multiples of 8 up to 128; decode steps take the
``sdpa_vector`` kernel (head dims 64, 96, 128, 256). Otherwise the same fallback as the
CPU's. This rule is read from MLX's source, not yet measured: ``benchmarks/gpu_bench.py``
compares the plan with MLX's peak on the GPU (docs/gpu.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxkv.memory.dtypes import dtype_bytes
from mlxkv.memory.layout import Layout

BASE_OVERHEAD = 400 * 10**6  # Python, MLX, mlx-lm, tokenizer, Metal/BLAS buffers
OVERHEAD_FRACTION = 0.05  # allocator rounding and MLX's buffer cache on top of live data


FUSED_PREFILL_HEAD_DIMS = (64, 72, 80, 96, 128)
CUDNN_MAX_HEAD_DIM = 128  # cuDNN's fused attention: head dims multiples of 8, at most this
CUDNN_DTYPES = ("float16", "bfloat16")


def _fused_head_dims(k: int, v: int, on: str) -> bool:
    if on == "metal":
        return k == v and k in FUSED_PREFILL_HEAD_DIMS
    if on == "cuda":
        return all(d % 8 == 0 and 0 < d <= CUDNN_MAX_HEAD_DIM for d in (k, v))
    return False


def fused_attention(layout: Layout, on: str, act_dtype: str | None = None) -> bool:
    """Whether a prefill chunk's attention runs a fused kernel on every layer: MLX's Metal
    kernel, or cuDNN's on CUDA (float16/bfloat16 activations only; None: not known)."""
    if on == "cuda" and act_dtype is not None and act_dtype not in CUDNN_DTYPES:
        return False
    for p in layout.specs():
        if p.cls == "QuantizedKVCache" or p.role == "mla":
            return False
        if p.kv_heads and not _fused_head_dims(p.k_head_dim, p.v_head_dim, on):
            return False
    return on in ("metal", "cuda")


@dataclass(frozen=True)
class Runtime:
    activation_bytes: int  # one prefill chunk through one layer (estimate)
    logits_bytes: int  # float32 logits + log-probs of the sampling step (estimate)
    overhead_bytes: int  # fixed runtime + allocator slack (estimate)
    fused_attention: bool = False  # no score matrix: a fused kernel (Metal, cuDNN)


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
    quantized: bool = False,
    sinks: int = 0,
) -> Runtime:
    f = layout.facts
    b = dtype_bytes(act_dtype)
    n = batch * min(chunk, max(context, 1))
    hidden, inter = f.hidden_size, f.intermediate_size or 4 * f.hidden_size
    # Residual stream, normed input, attention output, q/k/v, MLP gate/up/product.
    act = n * b * (6 * hidden + 3 * inter)
    fused = fused_attention(layout, on, act_dtype)
    heads, span = _attention_span(layout, context, window)
    if sinks and window is not None and context > window:  # a shifted copy of the sinks per query
        span += sinks * min(chunk, context)
    if not fused:  # the score matrix of one chunk, in the activation dtype
        act += n * heads * span * b
    if quantized:  # one layer's keys and values, dequantized for the chunk's attention
        per_token = max(
            (p.kv_heads * (p.k_head_dim + p.v_head_dim) for p in layout.specs() if p.grows),
            default=0,
        )
        act += batch * span * per_token * b
    logits = batch * f.vocab_size * 4 * 2
    overhead = BASE_OVERHEAD + int(OVERHEAD_FRACTION * (weights_bytes + kv_bytes))
    return Runtime(act, logits, overhead, fused)
