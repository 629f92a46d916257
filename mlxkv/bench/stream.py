"""One cache configuration through a long token stream, the way a long chat would fill it.

The stream is fed in prefill chunks (as the engine does). Per chunk we record the time
and the next-token loss of every position (so speed, flatness and perplexity come from the
same pass); at checkpoints the KV bytes the caches hold, MLX's peak memory and the
process's peak RSS. Decode speed is measured on a fresh cache right after the first chunk
("start") and after the whole stream ("end"), with mlx-lm's own ``generate_step`` for both
sides, so the only difference between an mlxkv run and an mlx-lm run is the cache objects.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


@dataclass
class Checkpoint:
    tokens: int
    kv_bytes: int  # sum of the caches' nbytes
    mlx_peak: int  # MLX peak memory since the stream started (weights included)
    process_peak: int | None  # peak RSS since the stream started (Linux), bytes


@dataclass
class StreamResult:
    name: str
    tokens: int
    chunk: int  # the prefill step asked for (sink caches take smaller ones once evicting)
    chunk_seconds: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    losses: np.ndarray | None = None  # next-token NLL per position (nats)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    decode_start_tps: float | None = None
    decode_end_tps: float | None = None

    @property
    def prefill_tps(self) -> float:
        return self.tokens / sum(self.chunk_seconds)

    def chunk_tps(self) -> np.ndarray:
        return np.asarray(self.chunk_tokens) / np.asarray(self.chunk_seconds)

    def chunk_ends(self) -> np.ndarray:
        return np.cumsum(self.chunk_tokens)

    def span_tps(self, lo: float, hi: float, start: int = 0) -> float:
        """Tokens per second over the chunks ending in the fraction (lo, hi] of the
        stream's tokens [start, end)."""
        ends = self.chunk_ends()
        a, b = (start + f * (self.tokens - start) for f in (lo, hi))
        pick = np.flatnonzero((ends > a) & (ends <= b) & (ends - self.chunk_tokens >= start))
        if not len(pick):  # at least one chunk
            pick = [min(int(np.searchsorted(ends, a, side="right")), len(ends) - 1)]
        secs = sum(self.chunk_seconds[i] for i in pick)
        return sum(self.chunk_tokens[i] for i in pick) / secs

    def ppl(self, lo: int = 0, hi: int | None = None) -> float:
        return float(np.exp(self.losses[lo:hi].mean()))


def reset_process_peak() -> bool:
    """Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def process_peak() -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _chunk_losses(logits, targets):
    import mlx.core as mx

    logits = logits[0].astype(mx.float32)
    picked = mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    return mx.logsumexp(logits, axis=-1) - picked


def decode_tps(model, caches, last_token: int, n: int) -> float:
    """Greedy decode of ``n`` tokens with mlx-lm's generate_step; tokens/s after the first."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    stamps = []
    steps = generate_step(mx.array([last_token]), model, max_tokens=n, prompt_cache=caches)
    for _ in steps:
        stamps.append(time.perf_counter())
    if len(stamps) < 2:
        return float("nan")
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


class NoGate:
    """Stands in for ``mlxkv.bench.pool.Gate`` when a stream runs alone."""

    @contextmanager
    def shared(self):
        yield

    @contextmanager
    def exclusive(self):
        yield


def run_stream(
    name: str,
    model,
    make: Callable[[], list],
    ids: list[int],
    chunk: int,
    checkpoints: tuple[int, ...],
    decode: int,
    decode_start: bool = True,
    on_chunk: Callable[[int, int], None] | None = None,
    gate=None,
) -> StreamResult:
    """Feed ``ids[:-1]`` (targets ``ids[1:]``) through ``make()`` caches in chunks.

    ``gate`` (see ``mlxkv.bench.pool``): prefill chunks run ``shared`` with other workers,
    decode timings ``exclusive`` (decode is memory-bound: a neighbour's prefill slows it).
    """
    import mlx.core as mx

    from mlxkv.caches import prefill_chunk

    gate = gate or NoGate()
    n = len(ids) - 1
    res = StreamResult(name, n, chunk)
    if decode and decode_start:
        # Start: a fresh cache, one chunk in, then decode.
        caches = make()
        with gate.shared():
            mx.eval(model(mx.array(ids[:chunk])[None], cache=caches))
        with gate.exclusive():
            res.decode_start_tps = decode_tps(model, caches, ids[chunk], decode)
        del caches
    mx.clear_cache()
    caches = make()
    mx.reset_peak_memory()
    reset_process_peak()
    tokens = mx.array(ids)
    losses = []
    marks = sorted(c for c in checkpoints if c <= n)
    done = 0
    while done < n:
        step = min(prefill_chunk(caches, chunk), n - done)  # as the engine feeds it
        with gate.shared():
            tic = time.perf_counter()
            logits = model(tokens[None, done : done + step], cache=caches)
            loss = _chunk_losses(logits, tokens[done + 1 : done + step + 1])
            mx.eval(loss, [c.state for c in caches])
            res.chunk_seconds.append(time.perf_counter() - tic)
        res.chunk_tokens.append(step)
        losses.append(np.array(loss))
        done += step
        while marks and marks[0] <= done:
            marks.pop(0)
            res.checkpoints.append(
                Checkpoint(
                    done, sum(c.nbytes for c in caches), mx.get_peak_memory(), process_peak()
                )
            )
        if on_chunk:
            on_chunk(done, n)
    res.losses = np.concatenate(losses)
    if decode:
        with gate.exclusive():
            res.decode_end_tps = decode_tps(model, caches, ids[n], decode)
    return res
