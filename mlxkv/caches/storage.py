"""How a cache stores key/value tokens: plain arrays, or MLX affine-quantized triples.

Every layout is (B, H, T, ...) along axis 2, so slicing and writing a token range is the
same code; only encode/decode/allocation differ.

A store works in its own *frame*: ``encode`` maps model-frame tokens into it, ``decode``
returns dense tokens in that frame, ``restore`` returns them in the model's frame (what RoPE
re-rotation needs), and attention must use ``queries(q)`` against decoded keys
(``scores`` / ``weigh`` do the products on the packed form without dequantizing):

* :class:`FloatStore` keeps tokens as they came; the frame is the model's.
* :class:`QuantStore` quantizes per token in groups along head_dim (mlx-lm's layout).
* :class:`RotatedKeyStore` (keys): subtracts a per-channel offset ``mu`` (the first token's
  key, per head), applies an orthonormal Hadamard rotation ``H`` of head_dim, then
  quantizes like :class:`QuantStore`. Key outliers sit in a few channels and persist across
  tokens; the offset removes their constant part and the rotation spreads the rest over all
  channels, so one group no longer has to span them. Attention stays exact up to the
  quantization error: ``q.(k - mu)`` differs from ``q.k`` by a constant per query, which
  softmax ignores, and ``(Hq).(Hk) = q.k``. Allocation grows in steps of
:data:`STEP` tokens, like mlx-lm's ``KVCache``, but as a pure function of the tokens held
(``capacity``), so the memory model can predict ``nbytes`` without knowing the chunk history.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_map

from mlxkv.memory.policy_bytes import STEP, capacity, round_up  # the one allocation rule
from mlxkv.policy import PolicyError

__all__ = ["STEP", "capacity", "round_up"]  # used by the caches as ``storage.capacity`` etc.


class FloatStore:
    """Tokens kept as they came (the model's dtype)."""

    quantized = False
    offset = None

    def encode(self, x: mx.array):
        return x

    def decode(self, s):
        return s

    def restore(self, s):
        return s

    def queries(self, q: mx.array) -> mx.array:
        return q

    def scores(self, q: mx.array, k) -> mx.array:
        return q @ k.swapaxes(-1, -2)

    def weigh(self, p: mx.array, v) -> mx.array:
        return p @ v

    def extra_nbytes(self) -> int:
        return 0

    def empty_like(self):
        """A store of the same kind, holding no state."""
        return type(self)()

    def zeros(self, like: mx.array, tokens: int):
        B, H, _, D = like.shape
        return mx.zeros((B, H, tokens, D), like.dtype)

    def describe(self) -> dict:
        return {}


class QuantStore:
    """Tokens kept as ``mx.quantize`` triples (packed uint32, scales, biases) along head_dim."""

    quantized = True
    scheme = "plain"
    offset = None

    def __init__(self, bits: int, group_size: int):
        self.bits = bits
        self.group_size = group_size

    def check(self, head_dim: int):
        if head_dim % self.group_size:
            raise PolicyError(
                f"--kv-group-size {self.group_size} does not divide the head dimension "
                f"{head_dim}; use a group size that divides it"
            )

    def encode(self, x: mx.array):
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def decode(self, s):
        return mx.dequantize(*s, group_size=self.group_size, bits=self.bits)

    def restore(self, s):
        return self.decode(s)

    def queries(self, q: mx.array) -> mx.array:
        return q

    def scores(self, q: mx.array, k) -> mx.array:
        """``q @ k^T`` on the packed keys (no dequantized copy of the cache)."""
        return mx.quantized_matmul(
            q, *k, transpose=True, group_size=self.group_size, bits=self.bits
        )

    def weigh(self, p: mx.array, v) -> mx.array:
        """``p @ v`` on the packed values."""
        return mx.quantized_matmul(
            p, *v, transpose=False, group_size=self.group_size, bits=self.bits
        )

    def extra_nbytes(self) -> int:
        return 0

    def empty_like(self):
        return type(self)(self.bits, self.group_size)

    def zeros(self, like: mx.array, tokens: int):
        B, H, _, D = like.shape
        self.check(D)
        packed = D * self.bits // 32
        groups = D // self.group_size
        return (
            mx.zeros((B, H, tokens, packed), mx.uint32),
            mx.zeros((B, H, tokens, groups), like.dtype),
            mx.zeros((B, H, tokens, groups), like.dtype),
        )

    def describe(self) -> dict:
        return {"bits": self.bits, "group_size": self.group_size, "scheme": self.scheme}


def _hadamard(x: mx.array) -> mx.array:
    # Orthonormal and, for a power-of-two size, its own inverse (Sylvester construction).
    return mx.hadamard_transform(x, scale=x.shape[-1] ** -0.5)


def rotates(head_dim: int) -> bool:
    """Whether :class:`RotatedKeyStore` rotates keys of this size (powers of two only: other
    sizes are only centred)."""
    return head_dim & (head_dim - 1) == 0


class RotatedKeyStore(QuantStore):
    """Keys centred by a per-channel offset and Hadamard-rotated, then quantized per token.

    ``offset`` (B, H, 1, D) is the first token's key (``offset_from = "mean"``: the mean key
    of the first update, which benchmarks/long_ppl.py compares), in the keys' dtype; it is
    part of the cache state and saved with it. The first token's key keeps chunked prefill
    identical to token-by-token decoding, whatever the chunk size.
    """

    scheme = "rotated"

    def __init__(self, bits: int, group_size: int):
        super().__init__(bits, group_size)
        self.offset = None

    def _rotate(self, x: mx.array) -> mx.array:
        return _hadamard(x) if rotates(x.shape[-1]) else x

    offset_from = "first"

    def encode(self, x: mx.array):
        if self.offset is None:
            if self.offset_from == "mean":
                self.offset = mx.mean(x, axis=2, keepdims=True)
            else:
                self.offset = mx.contiguous(x[..., :1, :])  # a copy, not a view of x
        return super().encode(self._rotate(x - self.offset))

    def restore(self, s):
        return self._rotate(self.decode(s)) + self.offset

    def queries(self, q: mx.array) -> mx.array:
        # Attention runs in the rotated frame; the offset needs nothing (softmax ignores it).
        return self._rotate(q)

    def extra_nbytes(self) -> int:
        return 0 if self.offset is None else self.offset.nbytes


def store_for(bits: int | None, group_size: int, scheme: str = "plain"):
    """The store for one tensor: float when ``bits`` is None, else quantized by ``scheme``."""
    if bits is None:
        return FloatStore()
    if scheme == "rotated":
        return RotatedKeyStore(bits, group_size)
    return QuantStore(bits, group_size)


# A quantized store is a tuple, or a list once mlx-lm's pipeline has rebound it through
# ``cache.keys = mx.depends(cache.keys, h)`` (which returns a list): both are triples.
TRIPLE = _TRIPLE = (tuple, list)


def tokens_of(s) -> int:
    return (s[0] if isinstance(s, _TRIPLE) else s).shape[2]


def take(s, a: int, b: int):
    """Token range [a, b) of a stored tensor (a view, no copy)."""
    return tree_map(lambda x: x[..., a:b, :], s)


def own(s):
    """``s`` in buffers of its own. A slice is a view that keeps the array it was cut from
    alive (a batch of rows, a prompt chunk's keys), and writing one over a whole array makes
    that array the view. ``mx.contiguous`` keeps a view that is contiguous already; a
    product is a new buffer."""
    if isinstance(s, _TRIPLE):
        return tuple(None if x is None else x * 1 for x in s)
    return s * 1


def write(s, a: int, v) -> None:
    """Write stored tokens ``v`` into slots [a, a + len) of ``s`` in place."""
    n = tokens_of(v)
    if isinstance(s, _TRIPLE):
        for dst, src in zip(s, v, strict=True):
            dst[..., a : a + n, :] = src
    else:
        s[..., a : a + n, :] = v


def concat(parts: list):
    if isinstance(parts[0], _TRIPLE):
        return tuple(mx.concatenate(list(p), axis=2) for p in zip(*parts, strict=True))
    return mx.concatenate(parts, axis=2)


def grow(s, zeros):
    return concat([s, zeros])


def nbytes(*buffers) -> int:
    """Bytes of the buffers (dense arrays, packed triples or None) together."""
    return sum(
        sum(x.nbytes for x in s) if isinstance(s, _TRIPLE) else s.nbytes
        for s in buffers
        if s is not None
    )


def shrink(s, tokens: int):
    """Keep the first ``tokens`` slots in a fresh buffer (so the old one can be freed)."""
    return tree_map(lambda x: mx.contiguous(x[..., :tokens, :]), s)
