"""Attention over a cache's own store, and the explicit routing of a model's attention to it.

mlx-lm's model modules import ``scaled_dot_product_attention`` from ``mlx_lm.models.base``
by name and call it with the layer's cache. :func:`route_attention` rebinds that name, in
each mlx-lm module a loaded model uses, to :func:`routed_attention`, which hands the call to
``cache.attend(...)`` when the cache offers one and to mlx-lm's function otherwise. So a
cache decides how its keys are multiplied (packed, rotated frame, ...) without pretending
to be mlx-lm's ``QuantizedKVCache``.
"""

from __future__ import annotations

import sys

import mlx.core as mx
from mlx_lm.models import base

_NAME = "scaled_dot_product_attention"
_MLX_LM = base.scaled_dot_product_attention


def grouped_queries(queries: mx.array, scale: float, n_kv: int) -> tuple[mx.array, int]:
    """Scaled queries shaped (B, n_kv, rep * L, D): the ``rep`` query heads that share a key
    head become rows of one matrix, and ``rep``.

    Keys and values are then multiplied as they are stored, never broadcast over query heads:
    MLX's quantized kernels have read a broadcast packed operand wrong (Metal's ``qvm_split_k``
    before ml-explore/mlx#3497; the CUDA backend's ``qmm_naive`` reads batch 0 for every batch
    of a partly broadcast operand) or found no kernel for it, and a dense product on the stored
    heads reads each key once."""
    B, n_q, L, D = queries.shape
    rep = n_q // n_kv
    q = queries * scale
    return (q.reshape(B, n_kv, rep * L, D) if rep > 1 else q), rep


def fused_mask(mask, queries: mx.array, values: mx.array):
    """``mask`` for ``mx.fast.scaled_dot_product_attention(queries, ..., values)``: where
    MLX will run cuDNN's fused attention on it, a boolean array becomes an additive one in
    the queries' dtype (0 where allowed, the dtype's lowest value where not), at its own
    shape; anywhere else the mask is left as it is.

    MLX's CUDA backend takes no boolean mask into cuDNN: it turns one into an additive array
    after broadcasting it to (B, query heads, L, T), as large as the scores, made at every
    call (``mlx/fast.cpp``) and held, one per call of every layer, until the chunk's graphs
    have run. Where MLX falls back to its unfused attention instead (the CPU, other dtypes
    or head sizes, one query row with an array mask), it copies the mask once per query
    head, and a boolean one costs a quarter of a float32 one there. Added to the scores, 0
    leaves them as they are and the lowest value gives a zero weight, as the boolean mask
    does."""
    if not isinstance(mask, mx.array) or mask.dtype != mx.bool_:
        return mask
    if not _cudnn_attention(queries, values):
        return mask
    dtype = queries.dtype
    return mx.where(mask, mx.array(0, dtype), mx.array(mx.finfo(dtype).min, dtype))


def _cudnn_attention(queries: mx.array, values: mx.array) -> bool:
    """Whether MLX runs cuDNN's fused attention for these queries with an array mask (by
    ``supports_sdpa_cudnn``, mlx/backend/cuda/scaled_dot_product_attention.cpp, MLX 0.32):
    a CUDA GPU as the default device, more than one query row, float16 or bfloat16, head
    sizes multiples of 8 up to 128."""
    if queries.shape[2] == 1 or queries.dtype not in (mx.float16, mx.bfloat16):
        return False
    if any(d % 8 or d > 128 for d in (queries.shape[-1], values.shape[-1])):
        return False
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def held_mask(mask, held: int, T: int, L: int):
    """``mask`` (None, "causal", boolean or additive, over the ``held`` leading slots) for a
    product over a buffer's ``T`` slots, the slots past ``held`` masked out.

    Packed caches attend on their whole buffer rather than its ``held`` prefix: a prefix
    slice is not contiguous, and MLX's CUDA quantized kernels take contiguous operands only
    (with a slice, ``quantized_matmul`` finds no kernel); the masked slots cost at most one
    allocation step (256 tokens) of reading."""
    if held >= T:
        return mask
    if mask is None:
        return mx.arange(T) < held
    if isinstance(mask, str):  # "causal": the queries are the last L held tokens
        return mx.arange(held - L, held)[:, None] >= mx.arange(T)[None]
    pad = [(0, 0)] * (mask.ndim - 1) + [(0, T - mask.shape[-1])]
    if mask.dtype == mx.bool_:
        return mx.pad(mask, pad, constant_values=False)
    return mx.pad(mask, pad, constant_values=mx.finfo(mask.dtype).min)


def weighted_values(scores, mask, rep: int, vstore, values, n_q: int, held=None) -> mx.array:
    """Softmax over ``scores`` (B, n_kv, rep * L, T) (masked: boolean, additive or
    "causal"; with ``held``, only the first ``held`` slots hold tokens), times the values
    (packed when the value store is quantized); heads back to (B, n_q, L, D)."""
    B, H, rows, T = scores.shape
    L = rows // rep
    if held is not None:
        mask = held_mask(mask, held, T, L)
    if rep > 1:
        scores = scores.reshape(B, H, rep, L, T)  # a mask broadcasts over the rep heads
    if mask is not None:
        if isinstance(mask, str):  # "causal"
            mask = mx.arange(T - L, T)[:, None] >= mx.arange(T)[None]
        if rep > 1 and mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    p = mx.softmax(scores, axis=-1, precise=True)
    if rep > 1:
        p = p.reshape(B, H, rows, T)
    out = vstore.weigh(p, values)
    return out.reshape(B, n_q, L, out.shape[-1]) if rep > 1 else out


def attention(queries, keys, values, scale: float, mask, kstore, vstore, held=None) -> mx.array:
    """Softmax attention with the products done by the stores (packed when quantized).

    ``queries`` (B, Hq, L, D) are already in the key store's frame; keys/values are the
    stores' native forms with Hk heads (Hq a multiple of Hk: grouped-query attention);
    ``held``: how many of their leading slots hold tokens (None: all).
    """
    first = keys[0] if isinstance(keys, (tuple, list)) else keys
    q, rep = grouped_queries(queries, scale, first.shape[1])
    scores = kstore.scores(q, keys)
    return weighted_values(scores, mask, rep, vstore, values, queries.shape[1], held)


def routed_attention(queries, keys, values, cache, scale: float, mask, sinks=None) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention``, but caches with ``attend`` compute their own."""
    attend = getattr(cache, "attend", None)
    if attend is not None:
        return attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    return _MLX_LM(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def route_attention(model) -> int:
    """Send ``model``'s attention calls through :func:`routed_attention`; returns how many
    mlx-lm modules were routed (idempotent; other caches behave exactly as before)."""
    names = {type(m).__module__ for m in model.modules()}
    routed = 0
    for name in names:
        mod = sys.modules.get(name)
        if mod is None or not name.startswith("mlx_lm."):
            continue
        fn = getattr(mod, _NAME, None)
        if fn is _MLX_LM:
            setattr(mod, _NAME, routed_attention)
        if getattr(mod, _NAME, None) is routed_attention:
            routed += 1
    return routed
