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
    """Scaled queries shaped (B, n_kv, rep, L, D) for grouped-query attention (as they are
    when every query head has its own key head), and ``rep``."""
    B, n_q, L, D = queries.shape
    rep = n_q // n_kv
    q = queries * scale
    return (q.reshape(B, n_kv, rep, L, D) if rep > 1 else q), rep


def expand_heads(s, rep: int):
    """Keys or values (arrays or quantized triples) with an axis for the ``rep`` query
    heads that share each key head."""
    if rep == 1:
        return s
    if isinstance(s, (tuple, list)):
        return tuple(mx.expand_dims(x, -3) for x in s)
    return mx.expand_dims(s, -3)


def weighted_values(scores, mask, rep: int, vstore, values, n_q: int) -> mx.array:
    """Softmax over ``scores`` (masked: boolean, additive or "causal"), times the values
    (packed when the value store is quantized); heads back to (B, n_q, L, D)."""
    if mask is not None:
        if isinstance(mask, str):  # "causal"
            q_len, k_len = scores.shape[-2:]
            mask = mx.arange(k_len - q_len, k_len)[:, None] >= mx.arange(k_len)[None]
        if rep > 1 and mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    p = mx.softmax(scores, axis=-1, precise=True)
    out = vstore.weigh(p, expand_heads(values, rep))
    if rep > 1:
        B, _, _, L, D = out.shape
        out = out.reshape(B, n_q, L, D)
    return out


def attention(queries, keys, values, scale: float, mask, kstore, vstore) -> mx.array:
    """Softmax attention with the products done by the stores (packed when quantized).

    ``queries`` (B, Hq, L, D) are already in the key store's frame; keys/values are the
    stores' native forms with Hk heads (Hq a multiple of Hk: grouped-query attention).
    """
    first = keys[0] if isinstance(keys, (tuple, list)) else keys
    q, rep = grouped_queries(queries, scale, first.shape[1])
    scores = kstore.scores(q, expand_heads(keys, rep))
    return weighted_values(scores, mask, rep, vstore, values, queries.shape[1])


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
