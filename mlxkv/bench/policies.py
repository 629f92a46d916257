"""Cache policies side by side with mlx-lm: speed, KV bytes, peak memory, flatness.

Two kinds of stream jobs (run by ``mlxkv.bench.pool``, side by side on a CPU):
- speed: a prompt longer than the window (so bounded caches are evicting), then greedy
  decode; every mlxkv policy and its mlx-lm peer, ``speed_repeats`` times each.
- long streams: selected configurations through a long token stream (bounded ones past
  the model's context, unbounded ones up to it), for KV bytes and peaks at checkpoints,
  speed over the stream (start vs end) and the losses the quality section reads.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from mlxkv.bench.configs import CacheConfig
from mlxkv.bench.pool import Job
from mlxkv.bench.stream import StreamResult


@dataclass
class SpeedPair:
    mlxkv: str
    peer: str
    runs: list[tuple[StreamResult, StreamResult]] = field(default_factory=list)

    def ratio(self, what: str) -> float:
        """Median over repeats of mlxkv / mlx-lm for ``prefill_tps`` or ``decode_end_tps``."""
        return statistics.median(_get(a, what) / _get(b, what) for a, b in self.runs)

    def median(self, side: int, what: str) -> float:
        return statistics.median(_get(r[side], what) for r in self.runs)


def _get(r: StreamResult, what: str) -> float:
    return r.prefill_tps if what == "prefill_tps" else getattr(r, what)


def _cost(tokens: int, bounded: bool, kept: int) -> float:
    """Rough relative run time: attention width grows with the kept tokens."""
    width = min(tokens, kept) if bounded else tokens / 2
    return tokens * (width + 2000)


def speed_jobs(configs: dict[str, CacheConfig], keys, scale) -> list[Job]:
    """Each mlxkv policy and its mlx-lm peer over the same prompt, ``speed_repeats`` times."""
    n = scale.speed_prompt
    jobs = []
    for key in keys:
        cfg = configs[key]
        for r in range(scale.speed_repeats):
            for c in (cfg, configs[cfg.peer]):
                cost = _cost(n, c.bounded, scale.kept)
                jobs.append(Job(f"speed/{key}/{r}/{c.key}", c.key, n, (n,), scale.speed_decode,
                                False, cost))  # fmt: skip
    return jobs


def speed_pairs(configs, keys, scale, results, log) -> list[SpeedPair]:
    pairs = []
    for key in keys:
        cfg = configs[key]
        pair = SpeedPair(key, cfg.peer)
        for r in range(scale.speed_repeats):
            a, b = (results[f"speed/{key}/{r}/{k}"] for k in (key, cfg.peer))
            pair.runs.append((a, b))
            log(
                f"speed {cfg.label} vs {configs[cfg.peer].label}: prefill {a.prefill_tps:.1f}/"
                f"{b.prefill_tps:.1f} tok/s, decode {a.decode_end_tps:.2f}/"
                f"{b.decode_end_tps:.2f} tok/s"
            )
        pairs.append(pair)
    return pairs


def stream_length(cfg: CacheConfig, stream_tokens: int, context: int | None) -> int:
    """Bounded caches go the whole way; unbounded ones stop at the model's context."""
    if cfg.bounded or not context:
        return stream_tokens
    return min(stream_tokens, context)


def stream_jobs(configs, keys, scale, context) -> list[Job]:
    jobs = []
    for key in keys:
        cfg = configs[key]
        n = stream_length(cfg, scale.stream_tokens, context)
        cost = _cost(n, cfg.bounded, scale.kept)
        jobs.append(Job(f"stream/{key}", key, n, scale.checkpoints, scale.stream_decode, True,
                        cost))  # fmt: skip
    return jobs


def streams_from(configs, keys, results, log) -> dict[str, StreamResult]:
    out = {}
    for key in keys:
        r = out[key] = results[f"stream/{key}"]
        log(
            f"stream {configs[key].label}: {r.prefill_tps:.1f} tok/s, first 10% "
            f"{r.span_tps(0, 0.1):.1f}, last 10% {r.span_tps(0.9, 1.0):.1f}; decode start "
            f"{r.decode_start_tps:.2f}, end {r.decode_end_tps:.2f} tok/s"
        )
    return out


def flatness(r: StreamResult, start: int = 0) -> dict:
    """Last 10% vs first 10% of the stream's tokens [start, end), for chunk throughput;
    decode at the start vs the end. A bounded cache starts at its size: before that it
    evicts nothing and attends to fewer keys, which says nothing about flatness."""
    first, last = r.span_tps(0, 0.1, start), r.span_tps(0.9, 1.0, start)
    return {
        "from_token": start,
        "first10_tps": first,
        "last10_tps": last,
        "last_over_first": last / first,
        "decode_start_tps": r.decode_start_tps,
        "decode_end_tps": r.decode_end_tps,
        "decode_end_over_start": (r.decode_end_tps or 0) / (r.decode_start_tps or float("nan")),
    }
