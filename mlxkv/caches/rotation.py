"""Pure RoPE rotations: shift keys that are already rotated by a constant number of positions.

mlx-lm models rotate keys before the cache sees them. RoPE scores depend only on the
query-key distance, so a cache can move a block of keys to other positions by rotating it
again by the difference. That is only sound when the model's rotation is a pure function of
position: a fixed set of frequencies, applied at ``position * scale``. Magnitude factors
(YaRN's mscale, LongRoPE's scale) are applied once by the model and must not be applied
again, so we rotate with the frequencies alone. Rotations whose frequencies depend on the
sequence length (dynamic NTK) cannot be shifted; :func:`rotation_of` refuses them by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import rope_utils

from mlxkv.memory.policy_bytes import shifts_ahead


class NotRepositionable(Exception):
    """The layer's position encoding cannot be shifted; the message names it."""


@dataclass(frozen=True, eq=False)
class Rotation:
    """``mx.fast.rope`` parameters of a model's RoPE, without magnitude factors."""

    dims: int
    traditional: bool = False
    base: float | None = 10000.0
    scale: float = 1.0
    freqs: mx.array | None = None

    def _rope(self, x: mx.array, offset: int) -> mx.array:
        return mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=self.base,
            scale=self.scale,
            offset=offset,
            freqs=self.freqs,
        )

    def shift(self, x: mx.array, d: int) -> mx.array:
        """Rotate every token of ``x`` (B, H, T, D) forward by ``d`` positions (may be < 0)."""
        if d == 0:
            return x
        # rope rotates element i of the sequence axis by offset + i: put tokens in a batch
        # axis so each one gets exactly ``d``.
        return self._rope(x[..., None, :], d)[..., 0, :]

    def shift_rows(self, x: mx.array, shifts: list[int]) -> mx.array:
        """Rotate row ``b`` of ``x`` (B, H, T, D) forward by ``shifts[b]`` positions, in one
        call (per-row offsets; bit for bit what ``shift`` gives each row alone)."""
        if len(set(shifts)) == 1:
            return self.shift(x, shifts[0])
        return self._rope(x[..., None, :], mx.array(shifts))[..., 0, :]

    def shifted_copies(self, x: mx.array, d0: int, m: int) -> mx.array:
        """(B, H, T, D) -> (B, H, T, m, D) where copy c of each token is shifted by d0 + c."""
        y = mx.broadcast_to(x[..., None, :], (*x.shape[:-1], m, x.shape[-1]))
        if d0 == 0 and m == 1:
            return y
        return self._rope(y, d0)

    def describe(self) -> dict:
        """JSON-able description (the frequencies travel separately as an array)."""
        return {
            "dims": self.dims,
            "traditional": self.traditional,
            "base": self.base,
            "scale": self.scale,
            "has_freqs": self.freqs is not None,
        }

    def same_as(self, other: Rotation) -> bool:
        if self.describe() != other.describe():
            return False
        if self.freqs is None:
            return True
        return self.freqs.shape == other.freqs.shape and bool(mx.all(self.freqs == other.freqs))


class ShiftsAhead:
    """A block of keys (sinks) rotated for a run of consecutive shifts, computed together.

    A decoding sink cache moves its sinks one position per token. ``mx.fast.rope`` has no
    fused CPU kernel (one call is a dozen small ops, ~0.1 ms for 4 sinks), so rotating per
    step cost ~6% of a decode step on the default model. ``get`` rotates the next
    ``shifts_ahead(S)`` shifts in one call (the chunk path's shifted copies: equal to
    ``shift`` bit for bit) and hands out one per step; many sinks rotate one step at a time,
    so the block stays small (``mlxkv.memory.policy_bytes.decode_scratch_bytes``).
    ``clear()`` when the keys change."""

    def __init__(self):
        self._first = None
        self._copies = None

    def clear(self) -> None:
        self._first = self._copies = None

    def get(self, rotation, x: mx.array, d: int) -> mx.array:
        """``rotation.shift(x, d)``, from the block when ``d`` is in it."""
        m = shifts_ahead(x.shape[-2])
        if m == 1:
            return rotation.shift(x, d)
        if self._first is None or not 0 <= d - self._first < m:
            self._first, self._copies = d, rotation.shifted_copies(x, d, m)
        return self._copies[..., d - self._first, :]


class Identity:
    """A layer without RoPE (NoPE): positions live nowhere in the keys, nothing to shift."""

    dims = 0

    def shift(self, x: mx.array, d: int) -> mx.array:
        return x

    def shifted_copies(self, x: mx.array, d0: int, m: int) -> mx.array:
        return mx.broadcast_to(x[..., None, :], (*x.shape[:-1], m, x.shape[-1]))

    def describe(self) -> dict:
        return {"identity": True}

    def same_as(self, other) -> bool:
        return isinstance(other, Identity)


_DYNAMIC = ("DynamicNTKScalingRoPE", "DynamicNTKAlphaRoPE")


def rotation_of(rope: nn.Module) -> Rotation:
    """The pure rotation of one RoPE module, or :class:`NotRepositionable` naming it."""
    name = type(rope).__name__
    if name in _DYNAMIC:
        raise NotRepositionable(
            f"{name} (dynamic NTK) changes its frequencies with the sequence length"
        )
    if type(rope) is nn.RoPE:
        return Rotation(rope.dims, rope.traditional, rope.base, rope.scale)
    if isinstance(rope, rope_utils.SuScaledRoPE):  # LongRoPE / su: fixed freqs + mscale
        return Rotation(rope.dim, False, None, 1.0, rope._freqs)
    if isinstance(rope, (rope_utils.Llama3RoPE, rope_utils.YarnRoPE, rope_utils.ProportionalRoPE)):
        return Rotation(rope.dims, rope.traditional, None, 1.0, rope._freqs)
    raise NotRepositionable(f"RoPE class {name} is not one mlxkv knows how to re-position")


def is_rope_module(m) -> bool:
    name = type(m).__name__
    return isinstance(m, nn.Module) and (
        type(m) is nn.RoPE
        or isinstance(
            m,
            (
                rope_utils.SuScaledRoPE,
                rope_utils.Llama3RoPE,
                rope_utils.YarnRoPE,
                rope_utils.ProportionalRoPE,
                rope_utils.DynamicNTKScalingRoPE,
            ),
        )
        or "RoPE" in name
        or "Rotary" in name
    )
