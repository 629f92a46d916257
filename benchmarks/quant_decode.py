"""Quantized KV decode speed and prefill peak memory, against mlx-lm's QuantizedKVCache.

    python benchmarks/quant_decode.py TEXT_FILE [--context 2048] [--steps 32] [--rounds 3]
        [--bits 4] [--chunk 512] [--model NAME_OR_PATH]

Decode: every cache is prefilled with the same ``--context`` tokens of the text, then the
caches take turns decoding ``--steps`` greedy tokens (mlx-lm's ``generate_step``), for
``--rounds`` rounds, so machine load hits every side alike; the median tokens/s per cache
and the ratio to mlx-lm's ``QuantizedKVCache(bits)`` are printed. Caches: mlxkv's default
(KIVI keys), mlxkv's rotated keys, mlx-lm's ``QuantizedKVCache``.

Prefill peak: the process's peak MLX memory while prefilling ``--context`` tokens in chunks
of ``--chunk`` into an unquantized full cache and into mlxkv's quantized ones (each from a reset
peak, the weights already loaded).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from mlxkv.backend import setup_blas

setup_blas()  # route MLX to OpenBLAS before anything imports MLX


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("text", type=Path)
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=512)
    args = ap.parse_args(argv)

    import mlx.core as mx
    from mlx_lm.models.cache import QuantizedKVCache

    from mlxkv.bench.stream import decode_tps
    from mlxkv.caches import make_caches
    from mlxkv.models.loader import load
    from mlxkv.models.resolve import resolve
    from mlxkv.policy import KVPolicy

    loaded = load(resolve(args.model).path)
    model = loaded.model
    text = args.text.read_text(encoding="utf-8", errors="replace")
    tokens = loaded.tokenizer.encode(text)[: args.context + 1]
    if len(tokens) < args.context + 1:
        print(f"note: the text has only {len(tokens)} tokens", file=sys.stderr)
    b = args.bits
    sides = {
        "mlxkv kivi": lambda: make_caches(model, KVPolicy(bits=b)),
        "mlxkv rotated": lambda: make_caches(model, KVPolicy(bits=b, key_scheme="rotated")),
        "mlx-lm QuantizedKVCache": lambda: [QuantizedKVCache(64, b) for _ in model.layers],
    }
    make_caches(model, KVPolicy(bits=b))  # routes the model's attention once, up front

    def prefill(caches):
        for p in range(0, len(tokens) - 1, args.chunk):
            x = mx.array(tokens[p : min(p + args.chunk, len(tokens) - 1)])[None]
            mx.eval(model(x, cache=caches))
            mx.clear_cache()

    peaks = {}
    for name, make in [("unquantized full", lambda: make_caches(model, KVPolicy()))] + list(
        sides.items()
    )[:2]:
        caches = make()
        mx.reset_peak_memory()
        prefill(caches)
        peaks[name] = mx.get_peak_memory()
        del caches
        mx.clear_cache()

    caches = {name: make() for name, make in sides.items()}
    for c in caches.values():
        prefill(c)
    tps = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, c in caches.items():
            tps[name].append(decode_tps(model, c, tokens[-1], args.steps))
    ref = statistics.median(tps["mlx-lm QuantizedKVCache"])
    print(
        f"# {loaded.name} ({loaded.dtype}), context {len(tokens) - 1}, {b}-bit, "
        f"{args.steps} steps x {args.rounds} rounds (interleaved)"
    )
    print("| cache | decode tok/s (median) | vs mlx-lm | rounds |")
    print("|---|---|---|---|")
    for name, v in tps.items():
        med = statistics.median(v)
        runs = ", ".join(f"{x:.1f}" for x in v)
        print(f"| {name} | {med:.1f} | {med / ref:.2f}x | {runs} |")
    print()
    print("| prefill | peak MLX memory MiB |")
    print("|---|---|")
    for name, p in peaks.items():
        print(f"| {name} | {p / 2**20:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
