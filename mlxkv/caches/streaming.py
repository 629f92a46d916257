"""Sink + sliding-window KV cache with StreamingLLM positions (optionally quantized).

What a query at token ``t`` attends to (``S`` sinks, window ``W``): every token while
``t < S + W``; afterwards the first ``S`` tokens (sinks) and the last ``W`` tokens up to and
including ``t``. Positions follow StreamingLLM: every query-key distance is the distance
*within the cache*. The window is contiguous and ends at the query, so its distances are
the true ones; only the sinks move: they sit right before the oldest kept window token,
i.e. shifted forward by ``D`` = the number of evicted tokens. We keep a full-precision copy
of the sink keys as the model rotated them (positions 0..S-1) and re-rotate that copy by
``D`` (never compounding rotations). ``window=None`` is a full cache (used for quantized
full caches), ``sinks=0`` a plain sliding window.

Layout of the key/value buffers (capacity grows in 256-token steps up to ``S + W``):
slots ``[0, S)`` hold the sinks (rotated for the current ``D``); token ``k >= S`` lives in
slot ``S + (k - S) % W``. Before the first eviction this is temporal order.

What ``update_and_fetch`` returns, and the mask ``make_mask`` builds for it beforehand:

* no eviction yet: the buffer prefix in temporal order, causal mask (like ``KVCache``);
* one token after evictions: the whole ring buffer, no mask (order is irrelevant);
* a chunk of ``N`` tokens after/with evictions: ``[sink copies][old window][chunk]``.
  Each chunk query ``t`` needs the sinks shifted by its own ``D(t)``; consecutive queries
  differ by one, so we return ``m`` shifted copies of the sinks (``S * m`` extra keys,
  ``m <= N``) and the mask lets each query see only its copy. This keeps chunked prefill
  exactly equal to token-by-token decoding, at the cost of ``S * N`` extra keys per chunk.

Precision: the model rotates new tokens at ``offset``. Since only distances matter, the
cache keeps ``offset`` small: every ``rebase_every`` evictions it rotates the window back by
the evicted count and reports positions relative to the oldest kept token (float32 RoPE
angles at position 3e5 are off by ~1e-2 rad; after a rebase positions stay below
``S + W + rebase_every``).

Quantized variant (:class:`QuantizedStreamingKVCache`): keys and values each go through a
store (``mlxkv.caches.storage``) with their own width and group size; keys by default in the
``rotated`` scheme (centred, Hadamard-rotated, per-token groups). The layout is the same
ring of slots, so windows, sinks, chunked prefill, trim and rebase work unchanged; sinks are
re-encoded from the full-precision copy (exact re-rotation, no compounding).

Attention interface (what any cache with a store frame must offer; the batched forms too):
``cache.attend(queries, keys, values, scale, mask, sinks=None)`` computes attention for the
``keys``/``values`` its own ``update_and_fetch`` just returned. mlxkv routes a loaded model's
attention calls there explicitly (:func:`mlxkv.caches.attention.route_attention`, installed
by ``make_caches``): mlx-lm's model modules call ``scaled_dot_product_attention`` by name, and
the routed function sends any cache that has ``attend`` to it. Decoding steps return the
packed store and ``attend`` multiplies on it (``mx.quantized_matmul`` for scores and for the
weighted values; no dequantized copy of the cache). Multi-token updates return dense
arrays in the store's frame and ``attend`` uses the fused ``mx.fast`` kernel with the
queries moved into that frame, so prefill never materialises quantized score matrices and
its peak memory stays at or below the unquantized cache's. Attention always sees keys and
values after a quantize/dequantize round trip, whatever the path, so prefill == decode.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from mlxkv.caches import storage as st
from mlxkv.caches.attention import attention
from mlxkv.caches.rotation import Identity, Rotation

DEFAULT_REBASE_EVERY = 4096
# A chunk of N tokens through an evicting sink cache attends to S * N extra keys (one
# shifted sink copy per query): at S=4, N=512 that is 2048 extra beside a 1020 window.
# Past the window the engine feeds sink caches this many tokens at a time instead.
# Measured on the default model, 2-core CPU (tok/s for chunk 32/64/96/256/512):
# 49.7/49.6/47.7/36.5/26.2, vs mlx-lm RotatingKVCache(1024, keep=4) at 512: 53.2.
SINK_PREFILL_CHUNK = 64


def prefill_chunk(caches, step: int) -> int:
    """How many tokens the next prefill call should feed (at most ``step``)."""
    return min((c.prefill_chunk(step) for c in caches if hasattr(c, "prefill_chunk")), default=step)


class StreamingKVCache(_BaseCache):
    """S attention sinks + a window of W tokens (or everything when ``window`` is None)."""

    def __init__(
        self,
        window: int | None,
        sinks: int = 0,
        rotation: Rotation | Identity | None = None,
        rebase_every: int | None = None,
        store=None,
        value_store=None,
    ):
        if window is None and sinks:
            raise ValueError("sinks need a window")
        if sinks and rotation is None:
            raise ValueError("sinks need the layer's rotation to be re-positioned")
        self.window = window
        self.sinks = sinks
        self.rotation = rotation
        if rebase_every is None and window is not None:
            rebase_every = max(sinks + window, DEFAULT_REBASE_EVERY)
        self.rebase_every = rebase_every
        self.kstore = store or st.FloatStore()
        self.vstore = value_store or (st.FloatStore() if store is None else store)
        self.keys = None
        self.values = None
        self.sink_keys = None  # full precision, rotated at positions 0..S-1
        self._n = 0  # tokens seen
        self._evicted = 0
        self._base = 0  # positions subtracted from the model's frame by rebases
        self._sink_shift = 0  # shift currently applied to the keys in slots [0, S)
        self._dense = False

    # ---- counters the engine reads (plain ints, no device sync) ----
    @property
    def offset(self) -> int:
        return self._n - self._base

    @property
    def tokens_seen(self) -> int:
        return self._n

    @property
    def kept(self) -> int:
        return self._n - self._evicted

    @property
    def evicted(self) -> int:
        return self._evicted

    def size(self) -> int:
        return self.kept

    def empty(self) -> bool:
        return self.keys is None

    @property
    def limit(self) -> int | None:
        return None if self.window is None else self.sinks + self.window

    @property
    def nbytes(self) -> int:
        return (
            st.nbytes(self.keys)
            + st.nbytes(self.values)
            + st.nbytes(self.sink_keys)
            + self.kstore.extra_nbytes()
        )

    @property
    def quantized(self) -> bool:
        return self.kstore.quantized or self.vstore.quantized

    def prefill_chunk(self, step: int) -> int:
        """Fill up to the limit in big chunks; once evicting, chunks of SINK_PREFILL_CHUNK."""
        if not self.sinks or self._temporal(self._n, step):
            return step
        room = self.limit - self._n
        return room if room > 0 else min(step, SINK_PREFILL_CHUNK)

    # ---- the arithmetic of positions ----
    def _d(self, t: int, e0: int) -> int:
        """Evicted count (= sink shift) once token ``t`` is in, starting from ``e0``."""
        return max(e0, t + 1 - self.sinks - self.window)

    def _temporal(self, P: int, N: int) -> bool:
        return self.window is None or (self._evicted == 0 and P + N <= self.limit)

    def _slot(self, k: int) -> int:
        return self.sinks + (k - self.sinks) % self.window

    def _ring_ranges(self, a: int, b: int):
        """Slot ranges (slot, length, first token) holding tokens [a, b), a >= S, b - a <= W."""
        if b <= a:
            return []
        s = self._slot(a)
        end = self.sinks + self.window
        if s + (b - a) <= end:
            return [(s, b - a, a)]
        first = end - s
        return [(s, first, a), (self.sinks, b - a - first, a + first)]

    # ---- mask, built before the update from the same arithmetic ----
    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        P = self._n
        if self._temporal(P, N):
            return create_attention_mask(N, P, return_array, window_size)
        if N == 1:
            return self._ring_mask(window_size)
        return self._chunk_mask(P, N, window_size)

    def _ring_mask(self, window_size):
        S, W = self.sinks, self.window
        n = self._n + 1
        e = self._d(self._n, self._evicted)
        a = S + e  # oldest window token kept
        count = n - a
        if count == W and (window_size is None or window_size >= S + W):
            return None
        r = mx.arange(W)
        age = (r - (a - S)) % W
        k = a + age  # token held in ring slot S + r
        ring = age < count
        sinks = mx.ones((S,), dtype=mx.bool_)
        if window_size is not None:
            t = n - 1
            ring = ring & (k > t - window_size)
            sinks = mx.arange(S) > t - window_size
        return mx.concatenate([sinks, ring])[None]

    def _layout(self, P: int, N: int):
        e0 = self._evicted
        d_first = self._d(P, e0)
        d_end = self._d(P + N - 1, e0)
        m = d_end - d_first + 1 if self.sinks else 0
        w_old = max(0, P - self.sinks - d_first)
        return e0, d_first, d_end, m, w_old

    def _chunk_mask(self, P: int, N: int, window_size):
        S, W = self.sinks, self.window
        e0, d_first, _, m, w_old = self._layout(P, N)
        t = mx.arange(P, P + N)[:, None]
        dt = mx.maximum(t + 1 - S - W, e0)
        oldest = S + dt
        parts = []
        if S:
            idx = mx.arange(S * m)[None]
            j, c = idx // m, idx % m
            vis = (j <= t) & ((dt - d_first) == c)
            if window_size is not None:
                vis = vis & (j > t - window_size)
            parts.append(vis)
        k = mx.arange(P - w_old, P + N)[None]
        vis = (k <= t) & (k >= oldest)
        if window_size is not None:
            vis = vis & (k > t - window_size)
        parts.append(vis)
        return mx.concatenate(parts, axis=1)

    # ---- updates ----
    def _ensure(self, keys: mx.array, values: mx.array, tokens: int):
        cap = st.capacity(tokens, self.limit)
        if self.keys is None:
            self.keys = self.kstore.zeros(keys, cap)
            self.values = self.vstore.zeros(values, cap)
            if self.sinks:
                self.sink_keys = mx.zeros((*keys.shape[:2], self.sinks, keys.shape[3]), keys.dtype)
        elif st.tokens_of(self.keys) < cap:
            extra = cap - st.tokens_of(self.keys)
            self.keys = st.grow(self.keys, self.kstore.zeros(keys, extra))
            self.values = st.grow(self.values, self.vstore.zeros(values, extra))

    def _fetch(self, store, s, a: int, b: int):
        part = s if (a == 0 and b == st.tokens_of(s)) else st.take(s, a, b)
        return store.decode(part) if self._dense else part

    def _set_sink_shift(self, d: int):
        if not self.sinks or d == self._sink_shift:
            return
        rotated = self.rotation.shift(self.sink_keys, d)
        st.write(self.keys, 0, self.kstore.encode(rotated))
        self._sink_shift = d

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        N = keys.shape[2]
        P, S = self._n, self.sinks
        self._dense = N > 1 and self.quantized
        if P < S:  # sink tokens keep their original rotation in the side copy
            self._ensure(keys, values, min(P + N, self.limit))
            self.sink_keys[..., P : min(S, P + N), :] = keys[..., : S - P, :]
        if self._temporal(P, N):
            self._ensure(keys, values, P + N)
            st.write(self.keys, P, self.kstore.encode(keys))
            st.write(self.values, P, self.vstore.encode(values))
            self._n = P + N
            return (
                self._fetch(self.kstore, self.keys, 0, P + N),
                self._fetch(self.vstore, self.values, 0, P + N),
            )
        if N == 1:
            return self._decode_step(keys, values)
        return self._chunk(keys, values)

    def _decode_step(self, keys, values):
        t = self._n
        slot = self._slot(t)
        st.write(self.keys, slot, self.kstore.encode(keys))
        st.write(self.values, slot, self.vstore.encode(values))
        self._evicted = self._d(t, self._evicted)
        self._n = t + 1
        self._set_sink_shift(self._evicted - self._base)
        out = self.keys, self.values
        self._maybe_rebase()  # builds new buffers; ``out`` keeps this step's frame
        return out

    def _chunk(self, keys, values):
        P, N, S = self._n, keys.shape[2], self.sinks
        e0, d_first, d_end, m, w_old = self._layout(P, N)
        self._ensure(keys, values, self.limit)
        enc_k, enc_v = self.kstore.encode(keys), self.vstore.encode(values)
        if P < S:
            st.write(self.keys, P, st.take(enc_k, 0, S - P))
            st.write(self.values, P, st.take(enc_v, 0, S - P))
        kdense, vdense = self.kstore.decode, self.vstore.decode
        parts_k, parts_v = [], []
        if S:
            B, H, _, Dk = keys.shape
            copies = self.rotation.shifted_copies(self.sink_keys, d_first - self._base, m)
            ck = kdense(self.kstore.encode(copies.reshape(B, H, S * m, Dk)))
            sv = vdense(st.take(self.values, 0, S))
            cv = mx.broadcast_to(sv[..., None, :], (*sv.shape[:3], m, sv.shape[-1]))
            parts_k.append(ck)
            parts_v.append(cv.reshape(B, H, S * m, sv.shape[-1]))
        for slot, length, _ in self._ring_ranges(P - w_old, P):
            parts_k.append(kdense(st.take(self.keys, slot, slot + length)))
            parts_v.append(vdense(st.take(self.values, slot, slot + length)))
        parts_k.append(kdense(enc_k))
        parts_v.append(vdense(enc_v))
        out = mx.concatenate(parts_k, axis=2), mx.concatenate(parts_v, axis=2)

        # Keep what the next token needs: the last W tokens after the sinks.
        for slot, length, first in self._ring_ranges(max(S, P, S + d_end), P + N):
            st.write(self.keys, slot, st.take(enc_k, first - P, first - P + length))
            st.write(self.values, slot, st.take(enc_v, first - P, first - P + length))
        self._evicted = d_end
        self._n = P + N
        self._set_sink_shift(d_end - self._base)
        self._maybe_rebase()
        return out

    def _maybe_rebase(self):
        if not isinstance(self.rotation, Rotation):
            return
        R = self._evicted - self._base
        if R < self.rebase_every:
            return
        S = self.sinks
        ring = self.kstore.restore(st.take(self.keys, S, S + self.window))
        ring = self.kstore.encode(self.rotation.shift(ring, -R))
        if S:  # the sinks' shift becomes 0 in the new frame: the pristine copy itself
            self.keys = st.concat([self.kstore.encode(self.sink_keys), ring])
        else:
            self.keys = ring
        self._base += R
        self._sink_shift = 0

    # ---- trim / rewind ----
    def trimmable(self) -> int:
        """Tokens that can be removed from the end: all of them before the first eviction,
        afterwards the window tokens still kept (the window then refills before evicting)."""
        if self._evicted == 0:
            return self._n
        return self._n - self.sinks - self._evicted

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = max(0, min(n, self.trimmable()))
        self._n -= n
        if self._n == 0:
            self.keys = self.values = self.sink_keys = None
            self.kstore.offset = None  # the next first update picks a new key offset
        elif self._evicted == 0:
            cap = st.capacity(self._n, self.limit)
            if st.tokens_of(self.keys) > cap:
                self.keys = st.shrink(self.keys, cap)
                self.values = st.shrink(self.values, cap)
        return n

    # ---- state ----
    @property
    def state(self):
        return self.keys, self.values, self.sink_keys

    @state.setter
    def state(self, v):
        self.keys, self.values, self.sink_keys = v

    @property
    def meta_state(self):
        return tuple(
            map(
                str,
                (
                    self.window,
                    self.sinks,
                    self._n,
                    self._evicted,
                    self._base,
                    self._sink_shift,
                    self.rebase_every,
                ),
            )
        )

    @meta_state.setter
    def meta_state(self, v):
        def num(x):
            return None if x == "None" else int(x)

        (
            self.window,
            self.sinks,
            self._n,
            self._evicted,
            self._base,
            self._sink_shift,
            self.rebase_every,
        ) = map(num, v)
        self._dense = False


class QuantizedStreamingKVCache(StreamingKVCache):
    """The same cache with keys and values quantized (each with its own width and groups)."""

    def __init__(
        self,
        window: int | None,
        sinks: int = 0,
        rotation=None,
        bits: int | None = 4,
        group_size: int = 64,
        rebase_every: int | None = None,
        *,
        key_bits: int | None = None,
        value_bits: int | None = None,
        value_group_size: int | None = None,
        key_scheme: str = "rotated",
    ):
        key_bits = bits if key_bits is None else key_bits
        value_bits = bits if value_bits is None else value_bits
        super().__init__(
            window,
            sinks,
            rotation,
            rebase_every,
            st.store_for(key_bits, group_size, key_scheme),
            st.store_for(value_bits, value_group_size or group_size),
        )
        self.group_size = group_size

    @classmethod
    def for_policy(cls, policy, rotation=None, rebase_every=None) -> QuantizedStreamingKVCache:
        return cls(
            policy.window,
            policy.sinks,
            rotation,
            None,
            policy.group_size,
            rebase_every,
            key_bits=policy.key_bits,
            value_bits=policy.value_bits,
            value_group_size=policy.value_group_size,
            key_scheme=policy.key_scheme,
        )

    def describe_stores(self) -> dict:
        return {"keys": self.kstore.describe(), "values": self.vstore.describe()}

    def attend(self, queries, keys, values, scale: float, mask, sinks=None) -> mx.array:
        """Attention of ``queries`` over what the last ``update_and_fetch`` returned."""
        if sinks is not None:
            raise ValueError("quantized KV caches do not support learned attention sinks")
        q = self.kstore.queries(queries)
        if self._dense:
            return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
        return attention(q, keys, values, scale, mask, self.kstore, self.vstore)

    @property
    def state(self):
        return self.keys, self.values, self.sink_keys, self.kstore.offset

    @state.setter
    def state(self, v):
        self.keys, self.values, self.sink_keys = v[:3]
        self.kstore.offset = v[3] if len(v) > 3 else None
