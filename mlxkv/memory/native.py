"""Byte-exact replicas of mlx-lm 0.32.2's cache growth (models/cache.py), as integer state.

Each tracker mirrors one cache class's buffer bookkeeping for a model call of ``n`` tokens
(``update``), in tokens along the sequence axis; the predictor multiplies by bytes per
token. ``logical`` is the tokens the cache semantically keeps, ``length`` the tokens the
buffer spans (what ``nbytes`` counts).

``key()`` is the state up to a shift along the sequence: two states with equal keys evolve
alike under equal calls, only translated. ``shift(d)`` applies such a translation of ``d``
tokens (``d`` a multiple of the period the predictor found), which lets a prefill of any
length be answered from one period of calls (``KVPredictor.prefill``).

Keep these in lock-step with mlx-lm's source: the exactness tests fail the moment mlx-lm
changes its steps or trims.
"""

from __future__ import annotations

from dataclasses import dataclass

STEP = 256  # KVCache / QuantizedKVCache / RotatingKVCache / ChunkedKVCache allocation step


def _grow(cap: int, prev: int, n: int) -> int:
    """KVCache.update_and_fetch: buffer length after storing n tokens after prev."""
    if cap == 0 or prev + n > cap:
        add = (STEP + n - 1) // STEP * STEP
        if cap == 0:
            return add
        if prev % STEP != 0:
            cap = prev  # the unused tail is sliced off before concatenating
        return cap + add
    return cap


@dataclass
class KVTracker:
    """KVCache and QuantizedKVCache (same growth rule)."""

    offset: int = 0
    length: int = 0

    def update(self, n: int) -> None:
        self.length = _grow(self.length, self.offset, n)
        self.offset += n

    @property
    def logical(self) -> int:
        return self.offset

    def key(self) -> tuple:
        return (self.length == 0, self.length - self.offset, self.offset % STEP)

    def shift(self, d: int) -> None:
        self.offset += d
        self.length += d


@dataclass
class RotatingTracker:
    """RotatingKVCache(max_size, keep): in-place for 1 token, concatenate for more."""

    max_size: int
    keep: int = 0
    offset: int = 0
    length: int = 0  # keys.shape[2]; 0 when keys is None
    idx: int = 0

    def update(self, n: int) -> None:
        if n == 1:
            self._in_place()
        else:
            self._concat(n)

    def _in_place(self) -> None:
        prev = self.offset
        if self.length == 0 or (prev >= self.length and self.length < self.max_size):
            self.length += min(STEP, self.max_size - prev)
            self.idx = prev
        if self.length - self.max_size > 0:
            self.length = self.max_size
            self.idx = self.max_size
        if self.idx == self.max_size:
            self.idx = self.keep
        self.offset += 1
        self.idx += 1

    def _concat(self, n: int) -> None:
        if self.length == 0:
            self.length = n
        else:
            # _temporal_order: unchanged length unless the buffer is not yet full.
            if not (self.idx == self.length or self.idx < self.offset):
                self.length = min(self.idx, self.length)
            trim = self.length - self.max_size + 1
            if trim > 0:
                self.length = min(self.keep, self.length) + max(0, self.length - trim - self.keep)
            self.length += n
        self.offset += n
        self.idx = self.length

    @property
    def logical(self) -> int:
        return min(self.offset, self.max_size)

    def key(self) -> tuple:
        # offset only matters while it is compared with length/idx (both stay below this).
        far = 2 * (self.max_size + self.length + STEP)
        return (self.length, self.idx, self.offset if self.offset < far else -1)

    def shift(self, d: int) -> None:
        self.offset += d


@dataclass
class ChunkedTracker:
    """ChunkedKVCache(chunk_size); the model calls maybe_trim_front before each update."""

    chunk_size: int
    offset: int = 0
    start: int = 0
    length: int = 0

    def update(self, n: int) -> None:
        if self.length:  # maybe_trim_front
            valid = self.offset - self.start
            if valid > self.chunk_size:
                trim = valid - self.chunk_size
                self.start += trim
                self.length = min(valid, self.length) - trim
        self.length = _grow(self.length, self.offset - self.start, n)
        self.offset += n

    @property
    def logical(self) -> int:
        # What survives the next maybe_trim_front: the last chunk_size tokens.
        return min(self.offset, self.chunk_size)

    def key(self) -> tuple:
        far = self.offset > self.chunk_size
        return (self.offset - self.start, self.length, far)

    def shift(self, d: int) -> None:
        self.offset += d
        self.start += d


@dataclass
class StateTracker:
    """ArraysCache: fixed-size states, present once the first token went through."""

    offset: int = 0

    def update(self, n: int) -> None:
        self.offset += n

    @property
    def length(self) -> int:
        return 1 if self.offset else 0

    logical = length

    def key(self) -> tuple:
        return (self.length,)

    def shift(self, d: int) -> None:
        self.offset += d


@dataclass
class NoneTracker:
    """A cache the model never fills."""

    offset: int = 0
    length: int = 0
    logical: int = 0

    def update(self, n: int) -> None:
        self.offset += n

    def key(self) -> tuple:
        return ()

    def shift(self, d: int) -> None:
        self.offset += d
