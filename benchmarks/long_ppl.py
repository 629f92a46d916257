"""Perplexity over a long text stream, past the model's training context, per cache policy.

    python benchmarks/long_ppl.py TEXT_FILE [--tokens 12288] [--window 1020] [--sinks 4]
        [--chunk 256] [--policies full,window,sink,...] [--model NAME_OR_PATH] [--json OUT]

The text (any UTF-8 file) is tokenized once and the first ``--tokens + 1`` tokens are fed
in chunks of ``--chunk``; every token's negative log-likelihood is recorded and reported
as perplexity over the part inside the training context, the part past it, and the last
2048 tokens. All bounded policies keep ``window + sinks`` tokens, so they compare at equal
memory. Policies:

* ``full``           every token kept (quadratic; its positions run past training length)
* ``window``         sliding window of ``window + sinks`` tokens, no sinks
* ``sink``           mlxkv: ``sinks`` sinks + ``window``, StreamingLLM positions
* ``sink-q8``/``sink-q4``/``window-q4``/``full-q8``/``full-q4``  quantized variants
* ``rotating``       mlx-lm ``RotatingKVCache(window + sinks, keep=sinks)`` with its decode
  semantics (sinks kept at their first positions, query positions unbounded). Evaluated
  exactly but in chunks with mlxkv's cache and an identity rotation: token-by-token
  decoding with mlx-lm's class gives the same logits (checked to 2e-6 on a small model)
  and would take hours here.
* ``rotating-chunked``  mlx-lm's class itself, fed in chunks as ``generate`` prefills a
  prompt; its multi-token mask hides the sink slots.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from mlxkv.backend import setup_blas

setup_blas()  # route MLX to OpenBLAS before anything imports MLX

POLICIES = {
    "full": dict(),
    "window": dict(window="W+S"),
    "sink": dict(window="W", sinks="S"),
    "rotating": "rotating",
    "rotating-chunked": "rotating-chunked",
    "sink-q8": dict(window="W", sinks="S", bits=8),
    "sink-q4": dict(window="W", sinks="S", bits=4),
    "window-q4": dict(window="W+S", bits=4),
    "full-q8": dict(bits=8),
    "full-q4": dict(bits=4),
}
DEFAULT = "full,window,sink,rotating,rotating-chunked,sink-q8,sink-q4,full-q8,full-q4"


def build_caches(model, name: str, window: int, sinks: int):
    from mlx_lm.models.cache import RotatingKVCache

    from mlxkv.caches import StreamingKVCache, make_caches
    from mlxkv.caches.rotation import Identity
    from mlxkv.policy import KVPolicy

    spec = POLICIES[name]
    if spec == "rotating":
        return [StreamingKVCache(window, sinks, Identity()) for _ in model.layers]
    if spec == "rotating-chunked":
        return [RotatingKVCache(window + sinks, keep=sinks) for _ in model.layers]
    sizes = {"W": window, "S": sinks, "W+S": window + sinks}
    kw = {k: sizes.get(v, v) for k, v in spec.items()}
    return make_caches(model, KVPolicy(**kw))


def token_nll(model, tokens: list[int], caches, chunk: int) -> list[float]:
    """NLL of tokens[1:] given everything before, feeding tokens[:-1] in chunks."""
    import mlx.core as mx

    nll = []
    for p in range(0, len(tokens) - 1, chunk):
        x = mx.array(tokens[p : min(p + chunk, len(tokens) - 1)])[None]
        y = mx.array(tokens[p + 1 : p + 1 + x.shape[1]])
        logits = model(x, cache=caches)[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        out = -mx.take_along_axis(lp, y[:, None], axis=-1)[:, 0]
        mx.eval(out)
        nll.extend(out.tolist())
        mx.clear_cache()
    return nll


def ppl(values: list[float]) -> float:
    return math.exp(sum(values) / len(values)) if values else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("text", type=Path)
    ap.add_argument("--model", default=None, help="model name or folder (default model)")
    ap.add_argument("--tokens", type=int, default=12288)
    ap.add_argument("--window", type=int, default=1020)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--policies", default=DEFAULT)
    ap.add_argument("--json", type=Path, help="append one JSON line per policy here")
    args = ap.parse_args(argv)

    from mlxkv.backend import blas
    from mlxkv.models.loader import load
    from mlxkv.models.resolve import resolve

    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        ap.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    loaded = load(resolve(args.model).path)
    ctx = loaded.context_length or 0
    text = args.text.read_text(encoding="utf-8", errors="replace")
    tokens = loaded.tokenizer.encode(text)[: args.tokens + 1]
    if len(tokens) < args.tokens + 1:
        print(f"note: the text has only {len(tokens)} tokens", file=sys.stderr)
    n = len(tokens) - 1
    print(
        f"# {loaded.name} ({loaded.dtype}), {n} tokens of {args.text.name}, training "
        f"context {ctx}, window {args.window} + sinks {args.sinks}, chunk {args.chunk}, "
        f"BLAS {blas()}"
    )
    print(f"| policy | ppl 0-{ctx} | ppl {ctx}-{n} | ppl last 2048 | KV MiB | s |")
    print("|---|---|---|---|---|---|")
    for name in names:
        caches = build_caches(loaded.model, name, args.window, args.sinks)
        t0 = time.time()
        nll = token_nll(loaded.model, tokens, caches, args.chunk)
        secs = time.time() - t0
        kv = sum(c.nbytes for c in caches) / 2**20
        row = {
            "policy": name,
            "model": loaded.name,
            "tokens": n,
            "context": ctx,
            "window": args.window,
            "sinks": args.sinks,
            "chunk": args.chunk,
            "ppl_in_context": ppl(nll[:ctx]),
            "ppl_past_context": ppl(nll[ctx:]),
            "ppl_last_2048": ppl(nll[-2048:]),
            "kv_mib": kv,
            "seconds": secs,
        }
        print(
            f"| {name} | {row['ppl_in_context']:.2f} | {row['ppl_past_context']:.2f} | "
            f"{row['ppl_last_2048']:.2f} | {kv:.1f} | {secs:.0f} |",
            flush=True,
        )
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
