"""How a cache stores key/value tokens: plain arrays, or MLX affine-quantized triples.

Both layouts are (B, H, T, ...) along axis 2, so slicing and writing a token range is the
same code; only encode/decode/allocation differ. Allocation grows in steps of
:data:`STEP` tokens, like mlx-lm's ``KVCache``, but as a pure function of the tokens held
(``capacity``), so the memory model can predict ``nbytes`` without knowing the chunk history.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_map

from mlxkv.policy import PolicyError

STEP = 256


def round_up(n: int, step: int = STEP) -> int:
    return (n + step - 1) // step * step


def capacity(tokens: int, limit: int | None) -> int:
    """Slots allocated when ``tokens`` must be held and at most ``limit`` ever are."""
    cap = round_up(tokens)
    return cap if limit is None else min(cap, limit)


class FloatStore:
    """Tokens kept as they came (the model's dtype)."""

    quantized = False

    def encode(self, x: mx.array):
        return x

    def decode(self, s):
        return s

    def zeros(self, like: mx.array, tokens: int):
        B, H, _, D = like.shape
        return mx.zeros((B, H, tokens, D), like.dtype)

    def describe(self) -> dict:
        return {}


class QuantStore:
    """Tokens kept as ``mx.quantize`` triples (packed uint32, scales, biases) along head_dim."""

    quantized = True

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
        return {"bits": self.bits, "group_size": self.group_size}


# A quantized store is a tuple, or a list once mlx-lm's pipeline has rebound it through
# ``cache.keys = mx.depends(cache.keys, h)`` (which returns a list): both are triples.
_TRIPLE = (tuple, list)


def tokens_of(s) -> int:
    return (s[0] if isinstance(s, _TRIPLE) else s).shape[2]


def take(s, a: int, b: int):
    """Token range [a, b) of a stored tensor (a view, no copy)."""
    return tree_map(lambda x: x[..., a:b, :], s)


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


def nbytes(s) -> int:
    if s is None:
        return 0
    if isinstance(s, _TRIPLE):
        return sum(x.nbytes for x in s)
    return s.nbytes


def shrink(s, tokens: int):
    """Keep the first ``tokens`` slots in a fresh buffer (so the old one can be freed)."""
    return tree_map(lambda x: mx.contiguous(x[..., :tokens, :]), s)
