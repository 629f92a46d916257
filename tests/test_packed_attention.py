"""Decode attention on packed keys and values at a GPU model's shapes, against dense
attention over the same dequantized tokens.

Llama-3.1-8B's attention shape (8 KV heads, 4 query heads on each, head_dim 128), bfloat16,
1,100 cached tokens (past 1,024, where Metal's quantized product switches to its split-K
kernel). On the CPU this checks the cache's packed products; the device check
(benchmarks/gpu_device.sh) runs it with a GPU as MLX's default device, where it checks
MLX's kernels: they have computed products on a broadcast packed operand from the wrong
heads (docs/gpu.md).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxkv.caches import cache_for
from mlxkv.caches.rotation import Rotation
from mlxkv.policy import KVPolicy
from tests._caches_ref import kivi_groups, quantize_dequantize

KV_HEADS, REP, D, T = 8, 4, 128, 1100
SCALE = D**-0.5
POLICIES = [
    KVPolicy(bits=4, group_size=64),  # KIVI keys
    KVPolicy(bits=8, group_size=64),
    KVPolicy(bits=4, group_size=64, key_scheme="plain"),
    KVPolicy(value_bits=4, group_size=64),
]


def _dense(q, k, v):
    """float32 attention with every query head's key head repeated: (1, H*REP, 1, D)."""
    k = mx.repeat(k.astype(mx.float32), REP, axis=1)
    v = mx.repeat(v.astype(mx.float32), REP, axis=1)
    s = (q.astype(mx.float32) * SCALE) @ k.swapaxes(-1, -2)
    return mx.softmax(s, axis=-1) @ v


def _as_cached(policy: KVPolicy, k, v):
    """The tokens as the cache holds them: keys per channel in complete groups along the
    tokens (KIVI) or per token (plain), values per token."""
    if policy.key_bits is not None:
        if policy.key_scheme == "kivi":
            k = kivi_groups(k, 0, policy.group_size, policy.key_bits)
        else:
            k = quantize_dequantize(k, policy.key_bits, policy.group_size)
    return k, quantize_dequantize(v, policy.value_bits, policy.value_group_size)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.describe())
def test_decode_on_packed_tokens_is_dense_attention_over_them(policy):
    key = mx.random.key(3)
    kk, kv, kq = mx.random.split(key, 3)
    k = mx.random.normal((1, KV_HEADS, T + 1, D), key=kk).astype(mx.bfloat16)
    v = mx.random.normal((1, KV_HEADS, T + 1, D), key=kv).astype(mx.bfloat16)
    q = mx.random.normal((1, KV_HEADS * REP, 1, D), key=kq).astype(mx.bfloat16)
    cache = cache_for(policy, Rotation(D, False, 500000.0, 1.0))
    for a in range(0, T, 512):
        cache.update_and_fetch(k[..., a : min(a + 512, T), :], v[..., a : min(a + 512, T), :])
    mask = cache.make_mask(1)
    keys, values = cache.update_and_fetch(k[..., T:, :], v[..., T:, :])
    got = cache.attend(q, keys, values, scale=SCALE, mask=mask).astype(mx.float32)
    want = _dense(q, *_as_cached(policy, k, v))
    err = mx.abs(got - want).mean().item()
    size = mx.abs(want).mean().item()
    # bfloat16 scores, weights and products (8 significant bits) on the CPU: a mean error of
    # 3-4% of the outputs' mean size (float32: none). Reading another head's tokens gives
    # about 130% (attention over head 0's tokens for every head, computed the same way).
    assert err < 0.2 * size, (err, size)
