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
* quantized variants: a base (``full``, ``window``, ``sink``) plus ``-q<b>`` (keys and
  values at b bits) or ``-k<b>v<b>`` (separate widths), optionally ``-g<G>`` (key group
  size), ``-vg<G>`` (value group size) and a key scheme: none (mlxkv's default, ``kivi``:
  keys per channel in groups of G consecutive tokens, the newest incomplete group in full
  precision), ``-rotated`` (centred + Hadamard, per-token groups), ``-plain`` (per-token
  groups of the raw keys, as mlx-lm's ``QuantizedKVCache`` stores them), ``-mean``
  (rotated, the offset is the mean key of the first chunk instead of the first token's key)
  or ``-kivifake`` (full policy only: a fake-quantized KIVI cache, :class:`KiviFakeCache`,
  which attention sees through the same keys/values a KIVI cache gives each query; a
  cross-check of the real cache). E.g. ``full-q4``, ``sink-k4v2-vg32``, ``full-q4-rotated``,
  ``sink-q3-plain``.
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
import sys
import time
from pathlib import Path

from mlxkv.backend import setup_blas

setup_blas()  # route MLX to OpenBLAS before anything imports MLX

from mlxkv.bench.long_ppl import (  # noqa: E402
    DEFAULT,
    POLICIES,
    build_caches,
    parse_policy,
    ppl,
    token_nll,
)


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
    unknown = [n for n in names if parse_policy(n) is None]
    if unknown:
        choices = ", ".join(POLICIES)
        ap.error(f"unknown policies {unknown}; choose from {choices} or a quantized form")
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
    past = f"ppl {ctx + 1}-{n}" if n > ctx else "ppl past context"
    print(f"| policy | ppl 1-{min(ctx, n)} | {past} | ppl last 2048 | KV MiB | s |")
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
            (
                f"| {name} | {row['ppl_in_context']:.2f} | {row['ppl_past_context']:.2f} | "
                f"{row['ppl_last_2048']:.2f} | {kv:.1f} | {secs:.0f} |"
            ).replace("| nan |", "| - |"),  # nothing past the context
            flush=True,
        )
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
