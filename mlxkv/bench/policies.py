"""Cache policies side by side with mlx-lm: speed, KV bytes, peak memory, flatness.

Two passes:
- speed: a prompt longer than the window (so bounded caches are evicting), then greedy
  decode; every mlxkv policy right after its mlx-lm peer, alternating who goes first.
- long streams: selected configurations through a long token stream (bounded ones past
  the model's context, unbounded ones up to it), for KV bytes and peaks at checkpoints,
  speed over the stream (start vs end) and the losses the quality section reads.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from mlxkv.bench.configs import CacheConfig
from mlxkv.bench.stream import StreamResult, run_stream


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


def speed(model, configs: dict[str, CacheConfig], keys, ids, scale, repeats, log):
    """Interleaved short streams for each mlxkv policy and its mlx-lm peer."""
    pairs = []
    for key in keys:
        cfg = configs[key]
        peer = configs[cfg.peer]
        pair = SpeedPair(key, peer.key)
        for r in range(repeats):
            order = (cfg, peer) if r % 2 == 0 else (peer, cfg)
            out = {}
            for c in order:
                out[c.key] = run_stream(
                    c.key, model, c.factory(model), ids, scale.chunk, (len(ids) - 1,),
                    scale.speed_decode, decode_start=False,
                )  # fmt: skip
            pair.runs.append((out[cfg.key], out[peer.key]))
            a, b = pair.runs[-1]
            log(
                f"speed {cfg.label} vs {peer.label}: prefill {a.prefill_tps:.1f}/"
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


def long_streams(model, configs, keys, ids, scale, context, log) -> dict[str, StreamResult]:
    out = {}
    for key in keys:
        cfg = configs[key]
        n = stream_length(cfg, scale.stream_tokens, context)
        every = max(1, (n // scale.chunk) // 4)

        def progress(done, total, label=cfg.label, every=every):
            if (done // scale.chunk) % every == 0 or done == total:
                log(f"stream {label}: {done}/{total} tokens")

        out[key] = run_stream(
            key, model, cfg.factory(model), ids[: n + 1], scale.chunk, scale.checkpoints,
            scale.stream_decode, on_chunk=progress,
        )  # fmt: skip
        r = out[key]
        log(
            f"stream {cfg.label}: {r.prefill_tps:.1f} tok/s, first 10% {r.span_tps(0, 0.1):.1f}, "
            f"last 10% {r.span_tps(0.9, 1.0):.1f}; decode start {r.decode_start_tps:.2f}, "
            f"end {r.decode_end_tps:.2f} tok/s"
        )
    return out


def flatness(r: StreamResult) -> dict:
    """Last 10% vs first 10% of the stream, for chunk throughput and for decode."""
    first, last = r.span_tps(0, 0.1), r.span_tps(0.9, 1.0)
    return {
        "first10_tps": first,
        "last10_tps": last,
        "last_over_first": last / first,
        "decode_start_tps": r.decode_start_tps,
        "decode_end_tps": r.decode_end_tps,
        "decode_end_over_start": (r.decode_end_tps or 0) / (r.decode_start_tps or float("nan")),
    }
