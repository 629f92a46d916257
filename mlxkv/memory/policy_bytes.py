"""Bytes of ONE growing attention layer under a KVPolicy: the caches' own arithmetic.

Pure integer arithmetic (no MLX import), the single source of truth shared by
``mlxkv.caches`` (which builds the caches) and the memory model (which predicts them).
The cache tests check ``allocated_bytes`` against the real caches' ``nbytes`` exactly.

Signatures (``dtype_bytes`` is the model/KV activation dtype: 4 fp32, 2 fp16/bf16)::

    kept_tokens(policy, tokens_seen) -> int
    evicted_tokens(policy, tokens_seen) -> int
    logical_bytes(policy, kv_heads, k_head_dim, v_head_dim, dtype_bytes, tokens_seen, batch)
    allocated_bytes(policy, kv_heads, k_head_dim, v_head_dim, dtype_bytes, tokens_seen,
                    batch)

Rules (``S`` sinks, ``W`` window, ``n`` tokens seen):

* kept = ``n`` for a full cache, ``min(n, S + W)`` otherwise; evicted = ``n - kept``.
* bytes per token per KV head and tensor of head dim ``D``: ``D * dtype_bytes``
  unquantized; quantized to ``b`` bits in groups of ``g``: ``D * b / 8`` (packed uint32)
  ``+ 2 * (D / g) * dtype_bytes`` (a scale and a bias per group, in the activation dtype).
  Keys use ``key_bits`` / ``group_size``, values ``value_bits`` / ``value_group_size``.
* logical = ``batch * kv_heads * kept * (row(k_head_dim) + row(v_head_dim))``.
* allocated = ``batch * kv_heads * (slots * (row(k) + row(v)) + sink_copy + offset)`` where
  ``slots = round_up(n, 256)`` for a full cache and ``min(round_up(n, 256), S + W)`` for a
  window, and ``sink_copy = S * k_head_dim * dtype_bytes`` when ``S > 0`` (the
  full-precision copy of the sink keys that re-positioning rotates from; quantized policies
  keep it unquantized too), and ``offset = k_head_dim * dtype_bytes`` when keys are
  quantized in the ``rotated`` scheme (the per-channel key offset). Zero when ``n == 0``.
* KIVI keys (``key_scheme == "kivi"`` with quantized keys, ``mlxkv.caches.kivi``) have
  their own layout: ``C = kivi_ring_slots(n)`` ring slots (``round_up(n - S, 256)``, at most
  ``G * ceil(W / G)`` for a window; 0 while ``n <= S``); per head, keys take
  ``C * D * b / 8`` packed bytes plus ``2 * D * (C / G) * dtype_bytes`` of per-channel scales
  and biases, a full-precision residual of ``G * D * dtype_bytes`` once ``C > 0``, and values
  ``(S + C)`` slots of ``row(v_head_dim)``; plus the sink copy as above. Logical bytes count
  the kept tokens at the packed key width plus one scale and bias per channel and group.
* Allocation depends only on ``n``: mlxkv's caches grow to ``round_up(n, 256)`` (not
  mlx-lm's history-dependent rule) and drop chunk-time buffers when an update returns, so
  the size of the last chunk does not change the result. (During a multi-token update a
  window cache briefly also holds the attended chunk; that is activation memory, not cache
  memory.)
* After ``trim`` a window cache may keep fewer tokens than ``kept_tokens`` says (its
  ``kept`` counter is exact); allocation follows the same rule with ``n`` = tokens seen.
"""

from __future__ import annotations

from mlxkv.policy import uses_kivi

STEP = 256


# A one-row decoding sink cache rotates its sinks for the next shifts together (one rope call
# per block: ~6% of a decode step on the default model when done per step), at most this many
# rotated sink keys per head: 32 shifts of 4 sinks. 32 shifts of 512 sinks held 4.6x the KV.
SINK_BLOCK_ROWS = 128
MOST_SHIFTS_AHEAD = 32


def shifts_ahead(sinks: int) -> int:
    """Shifts a decoding sink cache rotates at once (1: one per step, no block kept)."""
    return max(1, min(MOST_SHIFTS_AHEAD, SINK_BLOCK_ROWS // max(sinks, 1)))


def decode_scratch_bytes(policy, kv_heads: int, k_head_dim: int, dtype_bytes: int) -> int:
    """Bytes per layer of one decoding row's sink keys rotated ahead (beside the cache's
    ``nbytes``: the cache drops them when kept idle). Rotated one step at a time, a sink
    cache writes them into its key buffer; KIVI keeps this step's beside its packed ring.
    Batched caches keep none."""
    if not policy.sinks or policy.window is None:
        return 0
    m = shifts_ahead(policy.sinks)
    rows = policy.sinks * m if m > 1 else policy.sinks * uses_kivi(policy)
    return kv_heads * rows * k_head_dim * dtype_bytes


def undo_log_bytes(
    policy, reserve: int, kv_heads: int, k_head_dim: int, v_head_dim: int, dtype_bytes: int
) -> int:
    """Most bytes per layer of one row's undo log of ``reserve`` tokens (beside the cache's
    ``nbytes``; ``mlxkv.caches.streaming``). Each update it records, of at most ``reserve``
    + 1 tokens, keeps its input (keys and values as the model gives them) and a copy of the
    slots it overwrites (as stored); the log drops its oldest update once the newer ones
    cover ``reserve`` tokens, so it covers at most 2 x ``reserve`` tokens: one longest
    update and the ``reserve`` - 1 single steps after it. KIVI keys keep none."""
    if not reserve or policy.window is None or uses_kivi(policy):
        return 0
    stored = token_bytes(policy, kv_heads, k_head_dim, v_head_dim, dtype_bytes)
    given = kv_heads * (k_head_dim + v_head_dim) * dtype_bytes
    return 2 * reserve * (stored + given)


def round_up(n: int, step: int = STEP) -> int:
    return (n + step - 1) // step * step


def capacity(tokens: int, limit: int | None) -> int:
    """Slots allocated when ``tokens`` must be held and at most ``limit`` ever are: the
    rule the caches allocate by (``mlxkv.caches.storage`` imports it from here)."""
    cap = round_up(tokens)
    return cap if limit is None else min(cap, limit)


def kept_tokens(policy, tokens_seen: int) -> int:
    """Tokens a growing layer holds after ``tokens_seen`` tokens."""
    if policy.window is None:
        return tokens_seen
    return min(tokens_seen, policy.window + policy.sinks)


def evicted_tokens(policy, tokens_seen: int) -> int:
    return tokens_seen - kept_tokens(policy, tokens_seen)


def _row(bits, group_size: int, head_dim: int, dtype_bytes: int) -> int:
    if bits is None:
        return head_dim * dtype_bytes
    return head_dim * bits // 32 * 4 + 2 * (head_dim // group_size) * dtype_bytes


def kivi_ring_limit(window: int | None, group_size: int) -> int | None:
    """Ring slots of a KIVI window: whole groups covering the window (None: full cache)."""
    return None if window is None else -(-window // group_size) * group_size


def kivi_ring_slots(tokens_seen: int, sinks: int, window: int | None, group_size: int) -> int:
    """Ring slots a KIVI cache allocates after ``tokens_seen`` tokens (the sinks are apart)."""
    ring = tokens_seen - sinks
    return 0 if ring <= 0 else capacity(ring, kivi_ring_limit(window, group_size))


def _kivi_bytes(policy, k_head_dim, v_head_dim, dtype_bytes, tokens_seen) -> int:
    """Allocated bytes of one KIVI layer, one KV head, batch 1."""
    S, G, b = policy.sinks, policy.group_size, policy.key_bits
    C = kivi_ring_slots(tokens_seen, S, policy.window, G)
    keys = C * k_head_dim * b // 8 + 2 * k_head_dim * (C // G) * dtype_bytes
    residual = G * k_head_dim * dtype_bytes if C else 0
    values = (S + C) * value_row_bytes(policy, v_head_dim, dtype_bytes)
    sink_copy = S * k_head_dim * dtype_bytes
    return keys + residual + values + sink_copy


def key_row_bytes(policy, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of one key token of one head."""
    return _row(policy.key_bits, policy.group_size, head_dim, dtype_bytes)


def value_row_bytes(policy, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of one value token of one head."""
    return _row(policy.value_bits, policy.value_group_size, head_dim, dtype_bytes)


def token_bytes(policy, kv_heads: int, k_head_dim: int, v_head_dim: int, dtype_bytes: int) -> int:
    """Bytes per kept token (keys + values, all KV heads, batch 1)."""
    return kv_heads * (
        key_row_bytes(policy, k_head_dim, dtype_bytes)
        + value_row_bytes(policy, v_head_dim, dtype_bytes)
    )


def fixed_bytes(policy, kv_heads: int, k_head_dim: int, dtype_bytes: int) -> int:
    """Bytes that do not grow with tokens (batch 1): the full-precision sink keys and the
    per-channel key offset of the rotated key scheme."""
    sink_copy = policy.sinks * k_head_dim * dtype_bytes if policy.sinks else 0
    rotated = policy.key_bits is not None and policy.key_scheme == "rotated"
    offset = k_head_dim * dtype_bytes if rotated else 0
    return kv_heads * (sink_copy + offset)


def slots(policy, tokens_seen: int) -> int:
    """Token slots the cache allocates after ``tokens_seen`` tokens."""
    if tokens_seen <= 0:
        return 0
    return capacity(tokens_seen, policy.kept_tokens)


def logical_bytes(
    policy,
    kv_heads: int,
    k_head_dim: int,
    v_head_dim: int,
    dtype_bytes: int,
    tokens_seen: int,
    batch: int = 1,
) -> int:
    """Tokens kept x bytes per token (scales and biases included), whole batch."""
    per = token_bytes(policy, kv_heads, k_head_dim, v_head_dim, dtype_bytes)
    return batch * kept_tokens(policy, tokens_seen) * per


def allocated_bytes(
    policy,
    kv_heads: int,
    k_head_dim: int,
    v_head_dim: int,
    dtype_bytes: int,
    tokens_seen: int,
    batch: int = 1,
) -> int:
    """Exactly the ``nbytes`` of the cache mlxkv builds for one such layer."""
    if tokens_seen <= 0:
        return 0
    if uses_kivi(policy):
        return (
            batch * kv_heads * _kivi_bytes(policy, k_head_dim, v_head_dim, dtype_bytes, tokens_seen)
        )
    per = token_bytes(policy, kv_heads, k_head_dim, v_head_dim, dtype_bytes)
    fixed = fixed_bytes(policy, kv_heads, k_head_dim, dtype_bytes)
    return batch * (slots(policy, tokens_seen) * per + fixed)
