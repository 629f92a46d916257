"""KIVI's key store: keys quantized per channel, in groups of G consecutive tokens.

Key outliers sit in a few channels and persist across tokens, so a group that runs along the
token axis of one channel holds values of one scale (arXiv:2402.02750). The store keeps, for
B rows (a single cache is one row):

* the ring: keys transposed, ``K^T`` (B, H, D, C), quantized along the token axis, so
  ``mx.quantize`` on groups of ``G`` ring positions gives a scale and a bias per channel and
  group. Ring token ``u`` (token ``S + u``) has ring position ``u % C`` for a window (``C``
  = ``G * ceil(W / G)``) and ``u`` for a full cache; group ``u // G`` lives in group slot
  ``(u // G) % (C / G)``, boundaries fixed by the absolute token index;
* the residual: the newest ``< G`` ring tokens' keys (the group being filled) in full
  precision, (B, H, G, D). A group is quantized once its last token is in.

The store owns the group arithmetic (quantize, dequantize, write groups into their slots,
read dequantized ranges, pad the ring to a slot count, rebase, scores on the packed ring);
the caches (:mod:`mlxkv.caches.kivi`, :mod:`mlxkv.caches.batched_kivi`) own the rows'
positions, the values and the masks, through :mod:`mlxkv.caches.rows` like every other
sink + window cache.
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv.caches.rows import pad_axis, where_rows
from mlxkv.memory.policy_bytes import kivi_ring_limit, kivi_ring_slots


class KiviKeyStore:
    """How KIVI keys are stored; the ring and residual arrays are passed in and out."""

    scheme = "kivi"
    quantized = True

    def __init__(self, bits: int, group_size: int, window: int | None, sinks: int):
        self.bits, self.group_size = bits, group_size
        self.window, self.sinks = window, sinks
        self.limit = kivi_ring_limit(window, group_size)  # ring slots of a window; None: full

    def describe(self) -> dict:
        return {"bits": self.bits, "group_size": self.group_size, "scheme": self.scheme}

    # ---- positions in the ring ----
    def slots(self, n: int) -> int:
        """Ring slots a cache holding ``n`` tokens allocates (what policy_bytes predicts)."""
        return kivi_ring_slots(n, self.sinks, self.window, self.group_size)

    def pos(self, u: int) -> int:
        """Ring position of ring token ``u`` (= token ``S + u``)."""
        return u if self.limit is None else u % self.limit

    def held(self, ring) -> int:
        """Ring slots allocated in ``ring`` (0 for none)."""
        return 0 if ring is None else ring[1].shape[-1] * self.group_size

    def decode_mask(self, ts: list[int], oldest: list[int], C: int, window_size=None):
        """What each row's next token (token ``ts[b]``, its oldest kept window token
        ``oldest[b]``) sees among its ``S`` sinks and ``C`` ring slots: (B, S + C), or None
        when there is nothing to mask."""
        S = self.sinks
        t = mx.array(ts)[:, None]
        parts = []
        if S:
            j = mx.arange(S)[None]
            vis = j <= t
            if window_size is not None:
                vis = vis & (j > t - window_size)
            parts.append(vis)
        if C:
            r = mx.arange(C)[None]
            ut = t - S
            u = r if self.limit is None else ut - ((ut - r) % self.limit)
            k = S + u
            vis = (u >= 0) & (u <= ut) & (k >= mx.array(oldest)[:, None])
            if window_size is not None:
                vis = vis & (k > t - window_size)
            parts.append(vis)
        return mx.concatenate(parts, axis=1) if parts else None

    # ---- the group arithmetic ----
    def encode(self, k: mx.array):
        """``mx.quantize`` of keys (B, H, n*G, D) per channel along tokens: packed K^T."""
        kt = mx.contiguous(k.swapaxes(-1, -2))
        return tuple(mx.quantize(kt, group_size=self.group_size, bits=self.bits))

    def decode(self, q) -> mx.array:
        """Keys (B, H, n*G, D) back from packed K^T."""
        return mx.dequantize(*q, group_size=self.group_size, bits=self.bits).swapaxes(-1, -2)

    def zeros(self, rows: int, like: mx.array, C: int):
        """An empty ring of ``C`` slots and residual for ``rows`` rows shaped like the keys
        ``like`` (B, H, T, D)."""
        H, D, dt = like.shape[1], like.shape[3], like.dtype
        G = self.group_size
        ring = (
            mx.zeros((rows, H, D, C * self.bits // 32), mx.uint32),
            mx.zeros((rows, H, D, C // G), dt),
            mx.zeros((rows, H, D, C // G), dt),
        )
        return ring, mx.zeros((rows, H, G, D), dt)

    def fit(self, ring, C: int):
        """``ring`` zero-padded, or cut (into its own buffer), to ``C`` slots."""
        packed, scales, biases = ring
        g = C // self.group_size
        out = (pad_axis(packed, C * self.bits // 32, 3), pad_axis(scales, g, 3))
        out = (*out, pad_axis(biases, g, 3))
        if self.held(ring) > C:
            out = tuple(mx.contiguous(x) for x in out)
        return out

    def write_groups(self, ring, first_group: int, q, groups: int, row: int | None = None):
        """Write ``groups`` quantized groups (group indices from ``first_group``) into their
        group slots, in place (of one ``row`` only, when given). Only the newest ``C / G``
        matter when a chunk outruns a window's ring."""
        G, words = self.group_size, self.group_size * self.bits // 32
        nslots = None if self.limit is None else self.limit // G
        r = slice(None) if row is None else slice(row, row + 1)
        for i in range(0 if nslots is None else max(0, groups - nslots), groups):
            s = first_group + i if nslots is None else (first_group + i) % nslots
            ring[0][r, ..., s * words : (s + 1) * words] = q[0][r, ..., i * words : (i + 1) * words]
            ring[1][r, ..., s : s + 1] = q[1][r, ..., i : i + 1]
            ring[2][r, ..., s : s + 1] = q[2][r, ..., i : i + 1]

    def ring_keys(self, ring, a: int, b: int) -> list:
        """Dequantized keys (B, H, n, D) of ring tokens [a, b), in pieces (the ring wraps);
        only the groups that hold them are dequantized."""
        G, words = self.group_size, self.bits * self.group_size // 32
        out = []
        while a < b:
            p = self.pos(a)
            length = b - a if self.limit is None else min(b - a, self.limit - p)
            g0, g1 = p // G, -(-(p + length) // G)
            part = (ring[0][..., g0 * words : g1 * words], ring[1][..., g0:g1], ring[2][..., g0:g1])
            out.append(self.decode(part)[..., p - g0 * G : p - g0 * G + length, :])
            a += length
        return out

    def rebase(self, rotation, ring, residual, shifts: list[int]):
        """The ring and residual with row ``b``'s keys rotated by ``shifts[b]`` (rows with no
        shift keep theirs bit for bit): dequantize, rotate, quantize again."""
        new_ring = self.encode(rotation.shift_rows(self.decode(ring), shifts))
        new_res = rotation.shift_rows(residual, shifts)
        if all(shifts):
            return new_ring, new_res
        rows = [s != 0 for s in shifts]
        return where_rows(rows, new_ring, ring), where_rows(rows, new_res, residual)

    def scores(self, q: mx.array, ring, residual):
        """Scores of grouped queries (B, H, rows, D) against the packed ring (``q @ K^T``
        without a dequantized copy) and against the residual group."""
        s_ring = mx.quantized_matmul(
            q, *ring, transpose=False, group_size=self.group_size, bits=self.bits
        )
        return s_ring, q @ residual.swapaxes(-1, -2)
