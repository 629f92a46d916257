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
  a packed cache's decoding step gets the whole buffer, ``held`` naming the prefix;
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
store (``mlxkv.caches.storage``) with their own width and group size; keys in the per-token
``rotated`` (centred, Hadamard-rotated) or ``plain`` scheme; mlxkv's default KIVI keys have
their own cache, :mod:`mlxkv.caches.kivi`. The layout is the same
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

from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from mlxkv.caches import storage as st
from mlxkv.caches.attention import attention, fused_mask
from mlxkv.caches.errors import CacheError
from mlxkv.caches.rotation import Identity, Rotation, ShiftsAhead
from mlxkv.caches.rows import evicted_after, pad_tokens, rebase_shifts, sinks_at, where_rows

DEFAULT_REBASE_EVERY = 4096
# A chunk of N tokens through an evicting sink cache attends to S * N extra keys (one
# shifted sink copy per query): at S=4, N=512 that is 2048 extra beside a 1020 window.
# Past the window the engine feeds sink caches this many tokens at a time instead.
# Measured on the default model, 2-core CPU (tok/s for chunk 32/64/96/256/512):
# 49.7/49.6/47.7/36.5/26.2, vs mlx-lm RotatingKVCache(1024, keep=4) at 512: 53.2.
SINK_PREFILL_CHUNK = 64


@dataclass
class _Undo:
    """One evicting update, enough to take it back: the counters before it, what it
    overwrote in the ring (slot, length, keys, values), and its input (to replay a prefix)."""

    start: int
    evicted: int
    saved: list
    keys: mx.array
    values: mx.array


def _copy(s):
    # A slice would keep the whole old buffer alive; a copy holds only the saved slots.
    return tree_map(lambda x: mx.add(x, mx.zeros((), x.dtype)), s)


def _after(s, deps: list):
    """``s`` (an array or a packed triple), computed only after ``deps`` (arrays or triples)."""
    flat = [x for d in deps for x in (d if isinstance(d, st.TRIPLE) else (d,))]
    if isinstance(s, st.TRIPLE):
        return tuple(mx.depends(list(s), flat))
    return mx.depends(s, flat)


def _tuple(s):
    # files give lists back; quantized storage is a tuple (packed, scales, biases)
    return tuple(s) if isinstance(s, list) else s


def _rotation_state(rot) -> dict:
    if rot is None:
        return {"kind": "none"}
    if isinstance(rot, Identity):
        return {"kind": "identity"}
    return {
        "kind": "rope",
        "dims": rot.dims,
        "traditional": rot.traditional,
        "rope_base": rot.base,
        "scale": rot.scale,
        "freqs": rot.freqs,
    }


def _rotation_from_state(v: dict):
    kind = v["kind"]
    if kind == "none":
        return None
    if kind == "identity":
        return Identity()
    return Rotation(v["dims"], v["traditional"], v["rope_base"], v["scale"], v.get("freqs"))


def prefill_chunk(caches, step: int, evicting: int | None = None) -> int:
    """How many tokens the next prefill call should feed (at most ``step``; at most
    ``evicting``, default SINK_PREFILL_CHUNK, into a sink cache that evicts)."""
    evicting = evicting or SINK_PREFILL_CHUNK
    sizes = (c.prefill_chunk(step, evicting) for c in caches if hasattr(c, "prefill_chunk"))
    return min(sizes, default=step)


def check_sink_window(window: int | None, sinks: int, rotation) -> None:
    """The constructor checks every sink + window cache shares."""
    if window is None and sinks:
        raise ValueError("sinks need a window")
    if sinks and rotation is None:
        raise ValueError("sinks need the layer's rotation to be re-positioned")


def default_rebase_every(window: int | None, sinks: int) -> int | None:
    """How many evictions a cache lets pass before it rebases its positions."""
    return None if window is None else max(sinks + window, DEFAULT_REBASE_EVERY)


def rebase_ring(keys, sink_keys, kstore, rotation, window: int, shifts: list[int]):
    """The key slots of a ring layout (sinks in ``[0, S)``, the window after them) with
    row ``b`` moved into its new frame: its window keys rotated by ``shifts[b]``, its sink
    slots back to the pristine copy (their shift is 0 there). Rows with no shift keep their
    slots. Single caches (one row) and batched ones rebase with this."""
    S = 0 if sink_keys is None else sink_keys.shape[2]
    ring = kstore.restore(st.take(keys, S, S + window))
    ring = kstore.encode(rotation.shift_rows(ring, shifts))
    new = st.concat([kstore.encode(sink_keys), ring]) if S else ring
    if all(shifts):
        return new
    return where_rows([d != 0 for d in shifts], new, keys)


def sink_copies_mask(S: int, m: int, t: mx.array, copy: mx.array, window_size) -> mx.array:
    """Which of the S sinks' ``m`` rotated copies (laid out sink-major) the queries at
    absolute positions ``t`` (a column) see: sink j when it is not in their future, and
    only copy ``copy`` (per query: the one rotated for its own window start)."""
    idx = mx.arange(S * m)[None]
    j, c = idx // m, idx % m
    vis = (j <= t) & (copy == c)
    if window_size is not None:
        vis = vis & (j > t - window_size)
    return vis


class SinkWindowCounters(_BaseCache):
    """The counters the engine reads from a sink + window cache (plain ints, no device
    sync): ``_n`` tokens seen, ``_evicted`` dropped, ``_base`` positions rebased away."""

    window: int | None
    sinks: int
    _n = _evicted = _base = 0
    _ahead: ShiftsAhead  # decoding's sink rotations, several steps at a time

    def drop_scratch(self) -> None:
        """Let go of what only decoding uses (the sink rotations computed ahead: for 32
        steps, more than the sink keys themselves), for a cache kept idle."""
        self._ahead.clear()

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

    @property
    def limit(self) -> int | None:
        return None if self.window is None else self.sinks + self.window

    @classmethod
    def from_state(cls, state):
        """A new cache from ``state`` (mlx-lm's protocol), holding its own arrays: a cache
        writes into its buffers in place (slice assignment), so sharing them with the cache
        the state came from would let either one's later tokens leak into the other."""
        own = tree_map(lambda x: mx.array(x) if isinstance(x, mx.array) else x, state)
        cache = super().from_state(own)
        cache.regrow()  # a file's state keeps only the slots of its tokens
        return cache

    def regrow(self) -> None:
        """The buffers back to the step the memory model counts, after a file's state."""
        raise NotImplementedError


class StreamingKVCache(SinkWindowCounters):
    """S attention sinks + a window of W tokens (or everything when ``window`` is None)."""

    def __init__(
        self,
        window: int | None,
        sinks: int = 0,
        rotation: Rotation | Identity | None = None,
        rebase_every: int | None = None,
        store=None,
        reserve: int = 0,
        value_store=None,
    ):
        check_sink_window(window, sinks, rotation)
        self.window = window
        self.sinks = sinks
        self.rotation = rotation
        if rebase_every is None:
            rebase_every = default_rebase_every(window, sinks)
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
        self.held = None  # slots holding tokens, when a decoding step got a whole buffer
        self.reserve = reserve
        self._undo: list[_Undo] = []
        self._chunk_layout = False  # the last update returned [sink copies][old][chunk]
        self._ahead = ShiftsAhead()  # decoding's sink rotations, several steps at a time

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers attention reads (what the memory model predicts)."""
        return st.nbytes(self.keys, self.values, self.sink_keys) + self.kstore.extra_nbytes()

    @property
    def quantized(self) -> bool:
        return self.kstore.quantized or self.vstore.quantized

    def attend(self, queries, keys, values, scale: float, mask, sinks=None) -> mx.array:
        """Attention of ``queries`` over what the last ``update_and_fetch`` returned: dense
        arrays take the fused kernel (queries moved into the key store's frame), the packed
        store the products of :func:`mlxkv.caches.attention.attention`."""
        # keys_and_values() hands out dense keys in the model's frame: a KV-shared layer's
        # call passes them back (the id only, held until the next update: no dense copy kept)
        handed = id(keys) == getattr(self, "_handed", None)
        q = queries if handed else self.kstore.queries(queries)
        if not isinstance(keys, st.TRIPLE) and not isinstance(values, st.TRIPLE):
            return mx.fast.scaled_dot_product_attention(
                q, keys, values, scale=scale, mask=fused_mask(mask, q, values), sinks=sinks
            )
        if sinks is not None:
            raise ValueError("quantized KV caches do not support learned attention sinks")
        return attention(q, keys, values, scale, mask, self.kstore, self.vstore, self.held)

    def prefill_chunk(self, step: int, evicting: int) -> int:
        """Fill up to the limit in big chunks; once evicting, chunks of ``evicting``."""
        if not self.sinks or self._temporal(self._n, step):
            return step
        room = self.limit - self._n
        return room if room > 0 else min(step, evicting)

    # ---- the arithmetic of positions ----
    def _d(self, t: int, e0: int) -> int:
        """Evicted count (= sink shift) once token ``t`` is in, starting from ``e0``."""
        return evicted_after(t, self.sinks, self.window, e0)

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
        parts = [sink_copies_mask(S, m, t, dt - d_first, window_size)] if S else []
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

    def _fetch(self, store, s, n: int):
        """Slots [0, n) of buffer ``s``: dense for a multi-token update of a packed cache,
        else as stored; a decoding step of a packed cache gets the whole buffer (``attend``
        masks the slots past ``n``: MLX's CUDA quantized kernels take no sliced operand)."""
        if self.quantized and not self._dense:
            self.held = n
            return s
        part = s if n == st.tokens_of(s) else st.take(s, 0, n)
        return store.decode(part) if self._dense else part

    def _set_sink_shift(self, d: int, ahead: bool = False):
        if not self.sinks or d == self._sink_shift:
            return
        rotated = sinks_at(self.rotation, self.sink_keys, [d], self._ahead if ahead else None)
        st.write(self.keys, 0, self.kstore.encode(rotated))
        self._sink_shift = d

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        N = keys.shape[2]
        P, S = self._n, self.sinks
        self._dense = N > 1 and self.quantized
        self._chunk_layout = False
        self._handed = None
        self.held = None
        if P < S:  # sink tokens keep their original rotation in the side copy
            self._ahead.clear()
            self._ensure(keys, values, min(P + N, self.limit))
            self.sink_keys[..., P : min(S, P + N), :] = keys[..., : S - P, :]
            self.sink_keys = st.own(self.sink_keys)  # not a view of the whole chunk's keys
        if self._temporal(P, N):
            self._ensure(keys, values, P + N)
            st.write(self.keys, P, self.kstore.encode(keys))
            st.write(self.values, P, self.vstore.encode(values))
            self._n = P + N
            return (
                self._fetch(self.kstore, self.keys, P + N),
                self._fetch(self.vstore, self.values, P + N),
            )
        if N == 1:
            return self._decode_step(keys, values)
        return self._chunk(keys, values)

    def _decode_step(self, keys, values):
        t = self._n
        slot = self._slot(t)
        self._record(1, keys, values, [(slot, 1)])
        st.write(self.keys, slot, self.kstore.encode(keys))
        st.write(self.values, slot, self.vstore.encode(values))
        self._evicted = self._d(t, self._evicted)
        self._n = t + 1
        self._set_sink_shift(self._evicted - self._base, ahead=True)
        out = self.keys, self.values
        self._maybe_rebase()  # builds new buffers; ``out`` keeps this step's frame
        return out

    def _chunk(self, keys, values):
        P, N, S = self._n, keys.shape[2], self.sinks
        e0, d_first, d_end, m, w_old = self._layout(P, N)
        self._ensure(keys, values, self.limit)
        kept = self._ring_ranges(max(S, P, S + d_end), P + N)
        self._record(N, keys, values, [(slot, length) for slot, length, _ in kept])
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
        self._chunk_layout = True

        # Keep what the next token needs: the last W tokens after the sinks.
        for slot, length, first in kept:
            st.write(self.keys, slot, st.take(enc_k, first - P, first - P + length))
            st.write(self.values, slot, st.take(enc_v, first - P, first - P + length))
        self._evicted = d_end
        self._n = P + N
        self._set_sink_shift(d_end - self._base)
        self._maybe_rebase()
        return out

    def _maybe_rebase(self):
        shifts = rebase_shifts(
            self.rotation, self.window, self.rebase_every, [self._evicted], [self._base]
        )
        if shifts is None:
            return
        R = -shifts[0]
        self.keys = rebase_ring(
            self.keys, self.sink_keys, self.kstore, self.rotation, self.window, shifts
        )
        self._base += R
        self._sink_shift = 0
        for rec in self._undo:  # the undo log moves to the new frame with the ring
            rec.keys = self.rotation.shift(rec.keys, -R)
            rec.saved = [
                (slot, n, self.kstore.encode(self.rotation.shift(self.kstore.restore(k), -R)), v)
                for slot, n, k, v in rec.saved
            ]

    # ---- trim / rewind ----
    def trimmable(self) -> int:
        """Tokens that can be removed from the end *exactly*: leaving the cache as an uncached
        run over the remaining tokens would have left it.

        Before the first eviction that is every token. Once evicting, a token that left the
        window cannot be brought back, so only what the undo log covers can be removed (the
        updates since the last prefill chunk, at least ``reserve`` tokens of them once
        there are that many; none when ``reserve`` is 0); a trim that reaches back before
        the first eviction continues as a plain trim.
        """
        if self._evicted == 0:
            return self._n
        if not self._undo:
            return 0
        first = self._undo[0]
        return self._n - first.start + (first.start if first.evicted == 0 else 0)

    def trimmable_after(self, n: int) -> int:
        """At least what :meth:`trimmable` will say once an update of ``n`` tokens is in:
        all of them while the window has room, else the update itself where the undo log
        records it (at most ``recorded`` tokens), else none."""
        if self._evicted == 0 and (self.limit is None or self._n + n <= self.limit):
            return self._n + n
        return n if self.reserve and n <= self.recorded else 0

    @property
    def undo_nbytes(self) -> int:
        """Bytes the undo log holds beside ``nbytes`` (at most
        ``mlxkv.memory.policy_bytes.undo_log_bytes``)."""
        return sum(
            st.nbytes(r.keys, r.values, *(x for _, _, k, v in r.saved for x in (k, v)))
            for r in self._undo
        )

    @property
    def recorded(self) -> int:
        """The longest update the undo log records: a step of ``reserve`` drafts and the
        token before them (mlx-lm's speculative decoding feeds ``num_draft + 1``)."""
        return self.reserve + 1 if self.reserve else 0

    def is_trimmable(self) -> bool:
        """Whether trims are exact now (mlx-lm's question): before the first eviction, or
        while the undo log covers the last tokens. ``trimmable()`` says how many."""
        return self._evicted == 0 or bool(self._undo)

    def trim(self, n: int) -> int:
        """Remove the last ``min(n, trimmable())`` tokens exactly; returns how many."""
        n = max(0, min(n, self.trimmable()))
        target = self._n - n
        while self._undo and self._undo[-1].start >= target and self._evicted:
            self._undo_last()
        if self._n > target and self._evicted:  # inside the newest update: replay a prefix
            rec = self._undo.pop()
            self._restore(rec)
            self._replay(rec, target - rec.start)
        self._n = min(self._n, target)
        if self._n == 0:
            self.keys = self.values = self.sink_keys = None
            self._undo.clear()
            self.kstore.offset = None  # the next first update picks a new key offset
        elif self._evicted == 0:
            cap = st.capacity(self._n, self.limit)
            if st.tokens_of(self.keys) > cap:
                self.keys = st.shrink(self.keys, cap)
                self.values = st.shrink(self.values, cap)
        return n

    # ---- the undo log (exact trims after eviction) ----
    def _record(self, N: int, keys: mx.array, values: mx.array, slots: list) -> None:
        """Before an evicting update: keep what it will overwrite, and its input. An update
        longer than a step of ``reserve`` drafts (``recorded``) is a prefill chunk, which no
        rejected draft reaches into: the log is cleared instead, as recording it would
        hold the chunk's input and the slots it overwrote (a sink cache's 64-token chunks:
        half a window of 256 beside it, unreserved)."""
        if not self.reserve:
            return
        if N > self.recorded:
            self._undo.clear()
            return
        saved = [
            (
                slot,
                length,
                _copy(st.take(self.keys, slot, slot + length)),
                _copy(st.take(self.values, slot, slot + length)),
            )
            for slot, length in slots
        ]
        self._undo.append(_Undo(self._n, self._evicted, saved, keys, values))
        # The ring is read after this update: through it the copies are computed with the
        # step, before it is overwritten. Left lazy, each copy kept the whole buffer it was
        # taken from alive beside the new one (a window's KV more per layer and step).
        self.keys = _after(self.keys, [k for _, _, k, _ in saved])
        self.values = _after(self.values, [v for _, _, _, v in saved])
        while len(self._undo) > 1 and self._n + N - self._undo[1].start >= self.reserve:
            self._undo.pop(0)

    def _restore(self, rec: _Undo) -> None:
        for slot, _, k, v in rec.saved:
            st.write(self.keys, slot, k)
            st.write(self.values, slot, v)
        self._n, self._evicted = rec.start, rec.evicted
        if self.sinks:
            self._sink_shift = None  # rewrite the sink slots for the restored shift
            self._set_sink_shift(self._evicted - self._base)

    def _undo_last(self) -> None:
        self._restore(self._undo.pop())

    def _replay(self, rec: _Undo, m: int) -> None:
        """Feed the first ``m`` tokens of an undone update again (lazy: nothing computed
        but the cache writes)."""
        if m > 0:
            self.update_and_fetch(rec.keys[..., :m, :], rec.values[..., :m, :])
            self._dense = False

    # ---- mlx-lm's cache protocol beyond update/mask ----
    def keys_and_values(self):
        """Kept keys and values in temporal order (sinks at their current shift), dense.

        That is what the last update returned, and what its mask describes, except after a
        multi-token update that evicted (it returned shifted sink copies and the tokens it
        overwrote): then this raises :class:`CacheError` rather than hand a model that reads
        another layer's cache (KV-shared layers) keys its mask does not fit.
        """
        if self._chunk_layout:
            raise CacheError(
                "keys_and_values() after an evicting multi-token update has no layout its "
                "mask fits (attention reads another layer's window cache)"
            )
        if self.keys is None:
            return None, None
        S, kept = self.sinks, self.kept
        if not self._evicted:
            k, v = st.take(self.keys, 0, kept), st.take(self.values, 0, kept)
        else:
            ranges = self._ring_ranges(self._n - self.window, self._n)
            k = st.concat(
                [st.take(self.keys, 0, S)] + [st.take(self.keys, a, a + n) for a, n, _ in ranges]
            )
            v = st.concat(
                [st.take(self.values, 0, S)]
                + [st.take(self.values, a, a + n) for a, n, _ in ranges]
            )
        out = self.kstore.restore(k), self.vstore.restore(v)
        self._handed = id(out[0])
        return out

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """The same cache (window, sinks, positions) with keys and values stored at ``bits``
        with rotated per-token keys (mlx-lm's ``maybe_quantize_kv_cache`` calls it; the
        model's attention must be routed, see :mod:`mlxkv.caches.attention`)."""
        if self.quantized:
            # mlx-lm's generate calls this after every step once the start is reached
            k, v = self.kstore, self.vstore
            if (k.bits, v.bits, k.group_size) == (bits, bits, group_size):
                return self
            raise ValueError(f"the cache is already quantized to {k.bits} bits")
        q = QuantizedStreamingKVCache(
            self.window,
            self.sinks,
            self.rotation,
            bits,
            group_size,
            self.rebase_every,
            self.reserve,
        )
        if self.keys is None:
            return q
        state = dict(self.state)
        state.update(q.scheme_state())
        state.update(keys=q.kstore.encode(self.keys), values=q.vstore.encode(self.values))
        state.update(key_offset=q.kstore.offset)
        q.state = state
        return q

    # ---- state: everything needed to rebuild the cache from a file ----
    @property
    def state(self):
        """Arrays and scalars (mlx-lm 0.32.2's ``save_prompt_cache`` stores both). The undo
        log is not part of it: a loaded cache trims exactly only back to its first eviction."""
        rot = self.rotation
        return {
            "keys": self.keys,
            "values": self.values,
            "sink_keys": self.sink_keys,
            "window": self.window,
            "sinks": self.sinks,
            "tokens_seen": self._n,
            "evicted": self._evicted,
            "base": self._base,
            "sink_shift": self._sink_shift,
            "rebase_every": self.rebase_every,
            "reserve": self.reserve,
            "rotation": _rotation_state(rot),
            **self.scheme_state(),
            "key_offset": self.kstore.offset,
        }

    def stored_state(self) -> dict:
        """What a file keeps: before the first eviction the buffers hold the tokens in
        order from slot 0, and only those slots are kept (not the rest of the step)."""
        s = self.state
        if self.keys is not None and self._evicted == 0:
            s.update(keys=st.take(self.keys, 0, self._n), values=st.take(self.values, 0, self._n))
        return s

    def regrow(self) -> None:
        if self.keys is not None and self._evicted == 0:
            cap = st.capacity(self._n, self.limit)
            self.keys, self.values = pad_tokens(self.keys, cap), pad_tokens(self.values, cap)

    def scheme_state(self) -> dict:
        """How keys and values are stored (None: unquantized), as saved in a file."""
        k, v = self.kstore, self.vstore
        return {
            "key_bits": k.bits if k.quantized else None,
            "key_group_size": k.group_size if k.quantized else None,
            "key_scheme": k.scheme if k.quantized else None,
            "value_bits": v.bits if v.quantized else None,
            "value_group_size": v.group_size if v.quantized else None,
        }

    @state.setter
    def state(self, v):
        v = dict(v)
        self.window, self.sinks = v["window"], v["sinks"]
        self._n, self._evicted, self._base = v["tokens_seen"], v["evicted"], v["base"]
        self._sink_shift, self.rebase_every = v["sink_shift"], v["rebase_every"]
        self.reserve = v.get("reserve", 0)
        if "key_scheme" in v:
            self.kstore = st.store_for(v["key_bits"], v["key_group_size"], v["key_scheme"])
            self.vstore = st.store_for(v["value_bits"], v["value_group_size"])
            self.kstore.offset = v.get("key_offset")
        elif v.get("bits") is not None:  # files from before separate key/value stores
            self.kstore = st.store_for(v["bits"], v["group_size"], "plain")
            self.vstore = st.store_for(v["bits"], v["group_size"])
        else:
            self.kstore = self.vstore = st.FloatStore()
        if self.kstore.quantized:
            self.group_size = self.kstore.group_size
        self.rotation = _rotation_from_state(v["rotation"])
        self.keys, self.values, self.sink_keys = (
            _tuple(v[k]) for k in ("keys", "values", "sink_keys")
        )
        self._dense = False
        self._undo = []
        self._chunk_layout = False
        self._ahead = ShiftsAhead()


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
        reserve: int = 0,
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
            reserve,
            st.store_for(value_bits, value_group_size or group_size),
        )
        self.group_size = group_size

    @classmethod
    def for_policy(
        cls, policy, rotation=None, rebase_every=None, reserve: int = 0
    ) -> QuantizedStreamingKVCache:
        return cls(
            policy.window,
            policy.sinks,
            rotation,
            None,
            policy.group_size,
            rebase_every,
            reserve,
            key_bits=policy.key_bits,
            value_bits=policy.value_bits,
            value_group_size=policy.value_group_size,
            key_scheme=policy.key_scheme,
        )

    @property
    def key_bits(self) -> int | None:
        # No ``bits`` attribute on purpose: mlx-lm would route a cache with ``bits`` to its own
        # quantized attention, which knows nothing of the key store's frame.
        return self.kstore.bits if self.kstore.quantized else None

    @property
    def value_bits(self) -> int | None:
        return self.vstore.bits if self.vstore.quantized else None

    def describe_stores(self) -> dict:
        return {"keys": self.kstore.describe(), "values": self.vstore.describe()}
