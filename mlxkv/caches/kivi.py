"""KIVI keys: quantized per channel, in groups of G consecutive tokens (arXiv:2402.02750).

Key outliers sit in a few channels and persist across tokens, so a group that runs along the
token axis of one channel holds values of one scale, where a group along head_dim has to span
the outliers. Values stay quantized per token (groups along head_dim), as in
:class:`mlxkv.caches.storage.QuantStore`.

Layout (``S`` sinks, window ``W`` or None for a full cache, group ``G``):

* sinks: the first ``S`` tokens' keys in full precision, as the model rotated them
  (positions 0..S-1); attention rotates them forward by the evicted count (exact
  StreamingLLM positions, as :class:`~mlxkv.caches.streaming.StreamingKVCache` does). Their
  values sit in value slots ``[0, S)``.
* the ring and the residual: the keys of token ``k >= S`` (ring token ``u = k - S``) in
  the key store, :class:`mlxkv.caches.kivi_keys.KiviKeyStore`: packed ``K^T`` groups of
  ``G`` tokens at ring position ``u % C``, the group being filled in full precision.
  Group boundaries are fixed by the absolute token index, so chunked prefill equals
  token-by-token decoding exactly. Values of token ``k`` sit in value slot ``S + u % C``.

What a query at token ``t`` sees: the sinks, and the window tokens before ``t``'s group as
quantized keys, its own group's tokens up to ``t`` in full precision; values always as
quantized. With a window, tokens older than the window inside the oldest kept group are
masked out, so the attention set is exactly the unquantized sink + window policy's.

Decoding (one token) multiplies on the packed ring: ``mx.quantized_matmul(q, K^T,
transpose=False)`` gives ``q @ K^T`` without a dequantized copy; the residual's float scores
replace the positions of the group being filled (the rest of that group slot still holds
the tail of the group ``C`` tokens older, which the window may still see). Prefill chunks
attend with the fused kernel over dense keys: for each query the tokens of earlier groups
as quantized and the tokens of its own group in full precision (two copies of the chunk's
groups; the mask shows each query its own). Only the caller's chunk is ever dense.

Trim is exact within the residual (and anywhere before the first ring token); a trim into a
quantized group is not, so it is refused (the engine restores a copy instead). A rebase (every
``rebase_every`` evictions) dequantizes the ring, rotates it back and quantizes it again.
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv.caches import storage as st
from mlxkv.caches.attention import fused_mask, grouped_queries, weighted_values
from mlxkv.caches.errors import CacheError
from mlxkv.caches.kivi_keys import KiviKeyStore
from mlxkv.caches.rotation import ShiftsAhead
from mlxkv.caches.rows import evicted_after, pad_tokens, rebase_shifts, sinks_at
from mlxkv.caches.streaming import (
    SinkWindowCounters,
    _rotation_from_state,
    _rotation_state,
    check_sink_window,
    default_rebase_every,
    sink_copies_mask,
)
from mlxkv.policy import PolicyError


def _get_send_carrier(cache):
    return cache.values


def _set_send_carrier(cache, v) -> None:
    cache.values = tuple(v) if isinstance(v, list) else v  # mx.depends returns a list


# mlx-lm's pipeline models tie a rank's send of its output to its last layer's cache,
# ``cache[-1].keys = mx.depends(cache[-1].keys, h)``, so that the next step's attention
# runs the send (else the rank below waits for it forever). KIVI keys have no single
# array (a packed ring and a residual, either of which may be empty); the value store is
# read by every step, so it carries the dependency under the name mlx-lm uses.
PIPELINE_KEYS = property(_get_send_carrier, _set_send_carrier)


class KiviKVCache(SinkWindowCounters):
    """Sinks + window (or a full cache) with KIVI keys and per-token quantized values."""

    keys = PIPELINE_KEYS

    scheme = "kivi"
    # True where other layers read this cache (KV-shared models, see make_caches): then a
    # prefill chunk's dense keys and values are kept for keys_and_values() until the next
    # update. Elsewhere they are not, so they are freed as soon as attention has used them.
    shared = False

    def __init__(
        self,
        window: int | None,
        sinks: int = 0,
        rotation=None,
        key_bits: int = 4,
        group_size: int = 64,
        value_bits: int | None = 4,
        value_group_size: int | None = None,
        rebase_every: int | None = None,
    ):
        check_sink_window(window, sinks, rotation)
        self.window, self.sinks, self.rotation = window, sinks, rotation
        if rebase_every is None:
            rebase_every = default_rebase_every(window, sinks)
        self.rebase_every = rebase_every
        self.kstore = KiviKeyStore(key_bits, group_size, window, sinks)
        self.vstore = st.store_for(value_bits, value_group_size or group_size)
        self.ring = None  # (packed, scales, biases) of K^T, (B, H, D, C) before packing
        self.residual = None  # (B, H, G, D)
        self.values = None  # value store, slots [0, S) sinks then C ring slots
        self.sink_keys = None  # (B, H, S, D), rotated at positions 0..S-1
        self._n = self._evicted = self._base = 0
        self._fetched = None
        self._last = None  # what the last update returned (keys_and_values)
        self._ahead = ShiftsAhead()  # decoding's sink rotations, several steps at a time

    def empty(self) -> bool:
        return self.values is None

    def drop_scratch(self) -> None:
        super().drop_scratch()
        self._fetched = None  # this step's rotated sinks (in the block): only attend reads it

    @property
    def quantized(self) -> bool:
        return True

    @property
    def key_bits(self) -> int:
        return self.kstore.bits

    @property
    def group_size(self) -> int:
        return self.kstore.group_size

    @property
    def value_bits(self) -> int | None:
        return self.vstore.bits if self.vstore.quantized else None

    @property
    def nbytes(self) -> int:
        return st.nbytes(self.ring, self.residual, self.values, self.sink_keys)

    def describe_stores(self) -> dict:
        return {"keys": self.kstore.describe(), "values": self.vstore.describe()}

    # ---- arithmetic ----
    def _d(self, t: int) -> int:
        """Evicted count once token ``t`` is in."""
        return evicted_after(t, self.sinks, self.window, self._evicted)

    def prefill_chunk(self, step: int, evicting: int) -> int:
        """Like the float sink cache: big chunks up to the limit, ``evicting`` tokens once
        evicting (each chunk query gets its own shifted copy of the sinks)."""
        if not self.sinks or self.window is None:
            return step
        room = self.limit - self._n
        return min(step, room) if room > 0 else min(step, evicting)

    def _chunk_geometry(self, P: int, N: int):
        """Ranges (relative to the first ring token) that a chunk [P, P+N) attends to."""
        S, G = self.sinks, self.group_size
        u0, u1 = max(0, P - S), max(0, P + N - S)
        r0 = u0 // G * G  # start of the group being filled at P
        e = u1 // G * G  # end of the complete groups after the chunk
        # quantized keys are seen only by queries of later groups: up to the last one's
        e_seen = min(e, max(0, (u1 - 1) // G * G))
        lo = 0 if self.window is None else max(0, P - self.window + 1 - S)
        lo = min(lo, e_seen)
        d_first, d_end = self._d(P), self._d(P + N - 1)
        m = d_end - d_first + 1 if S else 0
        return u0, u1, r0, e, e_seen, lo, d_first, d_end, m

    # ---- masks, built before the update ----
    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        if N == 1:
            return self._decode_mask(window_size)
        return self._chunk_mask(N, window_size)

    def _decode_mask(self, window_size):
        t = self._n
        oldest = self.sinks + self._d(t)
        return self.kstore.decode_mask([t], [oldest], self.kstore.slots(t + 1), window_size)

    def _chunk_mask(self, N: int, window_size):
        S, G, P = self.sinks, self.group_size, self._n
        u0, u1, r0, _, e, lo, d_first, _, m = self._chunk_geometry(P, N)
        t = mx.arange(P, P + N)[:, None]
        dt = mx.maximum(t + 1 - S - (self.window or 0), self._evicted) if self.window else 0
        oldest = S + dt
        parts = [sink_copies_mask(S, m, t, dt - d_first, window_size)] if S else []
        own = mx.where(t >= S, (t - S) // G, -1)  # the query's group (-1: a sink query)
        segments = ((lo, e, False), (r0, u1, True)) if u1 > u0 else ()
        for a, b, same in segments:
            u = mx.arange(a, b)[None]
            k = S + u
            vis = (k <= t) & (k >= oldest) & (t >= S)
            vis = vis & (((u // G) == own) if same else ((u // G) < own))
            if window_size is not None:
                vis = vis & (k > t - window_size)
            parts.append(vis)
        return mx.concatenate(parts, axis=1)

    # ---- storage ----
    def _ensure(self, keys: mx.array, values: mx.array, n: int):
        """Allocate for ``n`` tokens held (the rule ``policy_bytes`` predicts)."""
        B, H, _, D = keys.shape
        S, C = self.sinks, self.kstore.slots(n)
        if self.values is None:
            self.values = self.vstore.zeros(values, S + C)
            if S:
                self.sink_keys = mx.zeros((B, H, S, D), keys.dtype)
        elif st.tokens_of(self.values) < S + C:
            extra = S + C - st.tokens_of(self.values)
            self.values = st.grow(self.values, self.vstore.zeros(values, extra))
        if self.ring is None:
            if C:
                self.ring, self.residual = self.kstore.zeros(B, keys, C)
        elif C > self.kstore.held(self.ring):
            self.ring = self.kstore.fit(self.ring, C)

    def _write_values(self, u_first: int, enc) -> None:
        """Write encoded values of ring tokens ``u_first..`` into their slots (wrapping)."""
        n = st.tokens_of(enc)
        C = self.kstore.limit
        skip = 0 if C is None else max(0, n - C)
        u, done = u_first + skip, skip
        while done < n:
            p = self.kstore.pos(u)
            length = n - done if C is None else min(n - done, C - p)
            st.write(self.values, self.sinks + p, st.take(enc, done, done + length))
            u, done = u + length, done + length

    def _shifted_sinks(self) -> mx.array:
        return sinks_at(self.rotation, self.sink_keys, [self._evicted - self._base], self._ahead)

    # ---- updates ----
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        P, N, S = self._n, keys.shape[2], self.sinks
        self._ensure(keys, values, P + N)
        if P < S:  # sink tokens: full precision keys, values in slots [0, S)
            self._ahead.clear()
            self.sink_keys[..., P : min(S, P + N), :] = keys[..., : S - P, :]
            self.sink_keys = st.own(self.sink_keys)  # not a view of the whole chunk's keys
            st.write(self.values, P, self.vstore.encode(values[..., : S - P, :]))
        self._last = None
        out = self._decode_step(keys, values) if N == 1 else self._chunk(keys, values)
        if N == 1 or self.shared:  # a step's output is the cache's own buffers: free to keep
            self._last = out
        return out

    def _decode_step(self, keys, values):
        t, S, G = self._n, self.sinks, self.group_size
        self._n = t + 1
        self._evicted = self._d(t)
        if t >= S:
            u = t - S
            i = u % G
            self.residual[..., i : i + 1, :] = keys
            self._write_values(u, self.vstore.encode(values))
            if i == G - 1:  # the group is complete: quantize it now (attention uses the residual)
                self.kstore.write_groups(self.ring, u // G, self.kstore.encode(self.residual), 1)
        sinks = self._shifted_sinks() if S else None  # this step's frame, before a rebase
        self._fetched = ("decode", t, self.residual, sinks)
        out = self.ring, self.values
        self._maybe_rebase()
        return out

    def _chunk(self, keys, values):
        P, N, S, G = self._n, keys.shape[2], self.sinks, self.group_size
        u0, u1, r0, e, e_seen, lo, d_first, d_end, m = self._chunk_geometry(P, N)
        vdec = self.vstore.decode
        parts_k, parts_v = [], []
        if S:
            B, H, _, D = keys.shape
            copies = self.rotation.shifted_copies(self.sink_keys, d_first - self._base, m)
            parts_k.append(copies.reshape(B, H, S * m, D))
            sv = vdec(st.take(self.values, 0, S))
            cv = mx.broadcast_to(sv[..., None, :], (*sv.shape[:3], m, sv.shape[-1]))
            parts_v.append(cv.reshape(B, H, S * m, sv.shape[-1]))
        if u1 > u0:  # ring tokens in this chunk
            skip = N - (u1 - u0)  # the chunk's sink tokens
            new_k = keys[..., skip:, :]
            enc_v = self.vstore.encode(values[..., skip:, :])
            held = self.residual[..., : u0 - r0, :]  # the group being filled, before P
            raw = new_k if u0 == r0 else mx.concatenate([held, new_k], axis=2)
            # values of ring tokens [a, u1) in token order
            a = min(lo, r0)
            pieces = [vdec(p) for p in self._ring_value_pieces(a, u0)] + [vdec(enc_v)]
            v_line = mx.concatenate(pieces, axis=2) if len(pieces) > 1 else pieces[0]
            if e > r0:
                q = self.kstore.encode(raw[..., : e - r0, :])
            if e_seen > lo:  # earlier groups, as quantized
                if lo < r0:
                    parts_k += self.kstore.ring_keys(self.ring, lo, min(r0, e_seen))
                if e_seen > r0:
                    dq = self.kstore.decode(q)
                    parts_k.append(dq[..., max(0, lo - r0) : e_seen - r0, :])
                parts_v.append(v_line[..., lo - a : e_seen - a, :])
            parts_k.append(raw)  # the groups being filled, in full precision
            parts_v.append(v_line[..., r0 - a : u1 - a, :])
        out = mx.concatenate(parts_k, axis=2), mx.concatenate(parts_v, axis=2)

        # keep what the next token needs
        if u1 > u0:
            self._write_values(u0, enc_v)
            if e > r0:
                self.kstore.write_groups(self.ring, r0 // G, q, (e - r0) // G)
            if u1 > e:
                self.residual[..., : u1 - e, :] = raw[..., e - r0 :, :]
        self._n = P + N
        self._evicted = d_end
        self._fetched = ("dense", P)
        self._maybe_rebase()
        return out

    def _ring_value_pieces(self, a: int, b: int) -> list:
        out = []
        while a < b:
            p = self.kstore.pos(a)
            length = b - a if self.kstore.limit is None else min(b - a, self.kstore.limit - p)
            out.append(st.take(self.values, self.sinks + p, self.sinks + p + length))
            a += length
        return out

    def _maybe_rebase(self):
        shifts = rebase_shifts(
            self.rotation, self.window, self.rebase_every, [self._evicted], [self._base]
        )
        if shifts is None:
            return
        self.ring, self.residual = self.kstore.rebase(
            self.rotation, self.ring, self.residual, shifts
        )
        self._base = self._evicted
        self._ahead.clear()

    # ---- attention ----
    def attend(self, queries, keys, values, scale: float, mask, sinks=None) -> mx.array:
        if sinks is not None:
            raise ValueError("quantized KV caches do not support learned attention sinks")
        if self._fetched is None or self._fetched[0] == "dense":
            return self._attend_dense(queries, keys, values, scale, mask)
        _, t, residual, sink_keys = self._fetched
        S, G = self.sinks, self.group_size
        n_kv = self.values[0].shape[1] if isinstance(self.values, tuple) else self.values.shape[1]
        q, rep = grouped_queries(queries, scale, n_kv)
        parts = []
        if S:
            parts.append(q @ sink_keys.swapaxes(-1, -2))
        if t >= S:
            s_ring, s_res = self.kstore.scores(q, keys, residual)
            u = t - S
            j = self.kstore.pos(u) // G * G
            blk = mx.where(mx.arange(G) <= u % G, s_res, s_ring[..., j : j + G])
            parts += [s_ring[..., :j], blk, s_ring[..., j + G :]]
        scores = mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
        v = values if t >= S else st.take(values, 0, S)
        return weighted_values(scores, mask, rep, self.vstore, v, queries.shape[1])

    def _attend_dense(self, queries, keys, values, scale: float, mask) -> mx.array:
        """The fused kernel, one block of queries per key group: each block sees the keys of
        its own group in full precision and those before as quantized, so the score matrix
        of one block (``G`` rows) is all that is live at a time, and prefill's peak stays
        below the unquantized cache's (whose chunk scores are ``N`` rows wide)."""
        N = queries.shape[2]
        rows = self._query_blocks(N)
        mask = fused_mask(mask, queries, values)
        if len(rows) == 1 or not isinstance(mask, mx.array):
            return mx.fast.scaled_dot_product_attention(
                queries, keys, values, scale=scale, mask=mask
            )
        outs = [
            mx.fast.scaled_dot_product_attention(
                queries[..., a:b, :], keys, values, scale=scale, mask=mask[..., a:b, :]
            )
            for a, b in rows
        ]
        return mx.concatenate(outs, axis=2)

    def _query_blocks(self, N: int) -> list[tuple[int, int]]:
        """Row ranges of the last chunk's queries that share a key group (sink queries,
        then one range per group)."""
        if self._fetched is None or len(self._fetched) < 2:
            return [(0, N)]
        P, S, G = self._fetched[1], self.sinks, self.group_size
        cuts = {0, N}
        if P < S < P + N:
            cuts.add(S - P)
        first = max(S, P)
        k = S + ((first - S) // G + 1) * G
        while k < P + N:
            cuts.add(k - P)
            k += G
        cuts = sorted(cuts)
        return list(zip(cuts[:-1], cuts[1:], strict=True))

    def keys_and_values(self):
        """What the last ``update_and_fetch`` returned, the layout its mask describes: the
        packed ring and values after a decoding step (as mlx-lm's ``QuantizedKVCache`` hands
        out packed triples), dense keys and values after a prefill chunk. A KV-shared layer
        (gemma3n, afm7) reads it and attends with its own queries through :meth:`attend`,
        which computes exactly what the layer that wrote the cache computed."""
        if self._last is not None or self.empty():
            return self._last if self._last is not None else (None, None)
        if self._fetched is not None and self._fetched[0] == "dense":
            raise CacheError(
                "keys_and_values() after a prefill chunk of a KIVI cache not built as shared "
                "(make_caches marks the caches of KV-shared models)"
            )
        raise CacheError(
            "keys_and_values() of a KIVI cache before its first update since it was "
            "loaded or trimmed (only an update's own layout has a mask)"
        )

    # ---- trim ----
    def trimmable(self) -> int:
        """Tokens that can be removed exactly: those in the residual (the group being filled),
        or all of them while every token is a sink; none once the window has evicted."""
        return 0 if self._evicted else self._residual(self._n)

    def trimmable_after(self, n: int) -> int:
        """What :meth:`trimmable` will say once an update of ``n`` tokens is in (none where
        the update reaches the window, which evicts)."""
        m = self._n + n
        if self._evicted or (self.window is not None and m > self.limit):
            return 0
        return self._residual(m)

    def _residual(self, n: int) -> int:
        return n if n <= self.sinks else (n - self.sinks) % self.group_size

    def is_trimmable(self) -> bool:
        return self.trimmable() > 0

    def trim(self, n: int) -> int:
        n = max(0, min(n, self.trimmable()))
        self._n -= n
        self._last = None
        if self._n == 0:
            self.ring = self.residual = self.values = self.sink_keys = None
            return n
        C = self.kstore.slots(self._n)
        if st.tokens_of(self.values) > self.sinks + C:
            self.values = st.shrink(self.values, self.sinks + C)
        if self.kstore.held(self.ring) > C:
            if C == 0:
                self.ring = self.residual = None
            else:
                self.ring = self.kstore.fit(self.ring, C)
        return n

    # ---- state ----
    @property
    def state(self):
        return {
            "ring": self.ring,
            "residual": self.residual,
            "values": self.values,
            "sink_keys": self.sink_keys,
            "window": self.window,
            "sinks": self.sinks,
            "tokens_seen": self._n,
            "evicted": self._evicted,
            "base": self._base,
            "rebase_every": self.rebase_every,
            "rotation": _rotation_state(self.rotation),
            "key_scheme": self.scheme,
            "key_bits": self.key_bits,
            "key_group_size": self.group_size,
            "value_bits": self.value_bits,
            "value_group_size": self.vstore.group_size if self.vstore.quantized else None,
        }

    @state.setter
    def state(self, v):
        v = dict(v)
        if v.get("key_scheme") != self.scheme:
            raise PolicyError(
                f"a {v.get('key_scheme')!r} key state cannot be loaded into a KIVI cache"
            )
        self.window, self.sinks = v["window"], v["sinks"]
        self._n, self._evicted, self._base = v["tokens_seen"], v["evicted"], v["base"]
        self.rebase_every = v["rebase_every"]
        self.rotation = _rotation_from_state(v["rotation"])
        self.kstore = KiviKeyStore(v["key_bits"], v["key_group_size"], self.window, self.sinks)
        self.vstore = st.store_for(v["value_bits"], v["value_group_size"] or self.group_size)
        ring = v["ring"]
        self.ring = None if ring is None else tuple(ring)
        vals = v["values"]
        self.values = tuple(vals) if isinstance(vals, list) else vals
        self.residual, self.sink_keys = v["residual"], v["sink_keys"]
        self._fetched = self._last = None
        self._ahead = ShiftsAhead()

    def stored_state(self) -> dict:
        """What a file keeps: the residual's rows in use (at least one); before the first
        eviction the values of the tokens (slots ``[0, n)``) and the ring's groups up to the
        one being filled, not the rest of the step."""
        s = self.state
        if self.residual is not None:
            rows = max(self._n - self.sinks, 0) % self.group_size
            s["residual"] = self.residual[..., : max(rows, 1), :]
        if self.values is not None and self._evicted == 0:
            s["values"] = st.take(self.values, 0, self._n)
            if self.ring is not None:
                used = st.round_up(max(self._n - self.sinks, 1), self.group_size)
                s["ring"] = self.kstore.fit(self.ring, used)
        return s

    def regrow(self) -> None:
        if self.residual is not None:
            self.residual = pad_tokens(self.residual, self.group_size)
        if self.values is not None and self._evicted == 0:
            C = self.kstore.slots(self._n)
            self.values = pad_tokens(self.values, self.sinks + C)
            if self.ring is not None:
                self.ring = self.kstore.fit(self.ring, C)

    @classmethod
    def for_policy(cls, policy, rotation=None, rebase_every=None) -> KiviKVCache:
        return cls(
            policy.window,
            policy.sinks,
            rotation,
            policy.key_bits,
            policy.group_size,
            policy.value_bits,
            policy.value_group_size,
            rebase_every,
        )
