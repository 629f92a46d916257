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
import math
import re
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
}
BASES = {"full": dict(), "window": dict(window="W+S"), "sink": dict(window="W", sinks="S")}
QUANT = re.compile(
    r"^(?P<base>full|window|sink)-(?:q(?P<b>\d)|k(?P<kb>\d)v(?P<vb>\d))"
    r"(?:-g(?P<g>\d+))?(?:-vg(?P<vg>\d+))?(?:-(?P<scheme>plain|rotated|mean|kivi|kivifake))?$"
)
DEFAULT = "full,window,sink,rotating,rotating-chunked,sink-q8,sink-q4,full-q8,full-q4"


def parse_policy(name: str):
    """(base spec, quantization keywords, scheme) for a policy name, or None if unknown."""
    if name in POLICIES:
        return POLICIES[name], {}, None
    m = QUANT.match(name)
    if not m:
        return None
    kb = int(m["b"] or m["kb"])
    vb = int(m["b"] or m["vb"])
    q = dict(key_bits=kb, value_bits=vb, group_size=int(m["g"] or 64))
    if m["vg"]:
        q["value_group_size"] = int(m["vg"])
    scheme = m["scheme"]
    if scheme == "kivifake" and m["base"] != "full":
        return None
    q["key_scheme"] = {"plain": "plain", "rotated": "rotated", "mean": "rotated"}.get(
        scheme, "kivi"
    )
    return BASES[m["base"]], q, scheme


class KiviFakeCache:
    """A full cache that hands attention KIVI-quantized keys (benchmark-only).

    Keys are quantized per channel in groups of ``g`` consecutive tokens once a group is
    complete; the newest incomplete group stays in full precision. For exactness in chunks,
    every update returns ``[all keys as the cache holds them][full-precision keys from the
    start of the first touched group]`` and the mask shows each query its own group from the
    second part and the complete groups before it from the first. Values are quantized per
    token (groups along head_dim), as KIVI does.
    """

    def __init__(self, key_bits: int, value_bits: int, g: int, vg: int):
        self.kb, self.vb, self.g, self.vg = key_bits, value_bits, g, vg
        self.raw = self.fq = self.vals = None
        self.offset = 0
        self.done = 0

    def _per_channel(self, x):
        import mlx.core as mx

        t = x.swapaxes(-1, -2)
        q = mx.quantize(t, group_size=self.g, bits=self.kb)
        return mx.dequantize(*q, group_size=self.g, bits=self.kb).swapaxes(-1, -2)

    def _per_token(self, x):
        import mlx.core as mx

        q = mx.quantize(x, group_size=self.vg, bits=self.vb)
        return mx.dequantize(*q, group_size=self.vg, bits=self.vb)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        import mlx.core as mx

        P = self.offset
        r0 = P // self.g * self.g
        t = mx.arange(P, P + N)[:, None]
        own = t // self.g * self.g
        j = mx.arange(P + N)[None]
        r = mx.arange(r0, P + N)[None]
        return mx.concatenate([j < own, (r >= own) & (r <= t)], axis=1)

    def update_and_fetch(self, keys, values):
        import mlx.core as mx

        def cat(a, b):
            return b if a is None else mx.concatenate([a, b], axis=2)

        P, N = self.offset, keys.shape[2]
        self.raw = cat(self.raw, keys)
        self.vals = cat(self.vals, self._per_token(values))
        self.offset = P + N
        complete = self.offset // self.g * self.g
        if complete > self.done:
            self.fq = cat(self.fq, self._per_channel(self.raw[..., self.done : complete, :]))
            self.done = complete
        held = self.raw[..., complete : self.offset, :]
        k = held if self.fq is None else mx.concatenate([self.fq, held], axis=2)
        r0 = P // self.g * self.g
        k = mx.concatenate([k, self.raw[..., r0:, :]], axis=2)
        v = mx.concatenate([self.vals, self.vals[..., r0:, :]], axis=2)
        return k, v

    @property
    def nbytes(self) -> int:
        # what a real KIVI cache would hold: packed keys per channel + residual + values
        B, H, T, D = self.raw.shape
        e = self.raw.dtype.size
        keys = B * H * (self.done * D * self.kb // 8 + 2 * D * (self.done // self.g) * e)
        resid = B * H * (T - self.done) * D * e
        vals = B * H * T * (D * self.vb // 8 + 2 * (D // self.vg) * e)
        return keys + resid + vals


def build_caches(model, name: str, window: int, sinks: int):
    from mlx_lm.models.cache import RotatingKVCache

    from mlxkv.caches import StreamingKVCache, make_caches
    from mlxkv.caches.rotation import Identity
    from mlxkv.policy import KVPolicy

    spec, quant, scheme = parse_policy(name)
    if scheme == "kivifake":
        g = quant["group_size"]
        vg = quant.get("value_group_size", g)
        return [KiviFakeCache(quant["key_bits"], quant["value_bits"], g, vg) for _ in model.layers]
    if spec == "rotating":
        return [StreamingKVCache(window, sinks, Identity()) for _ in model.layers]
    if spec == "rotating-chunked":
        return [RotatingKVCache(window + sinks, keep=sinks) for _ in model.layers]
    sizes = {"W": window, "S": sinks, "W+S": window + sinks}
    kw = {k: sizes.get(v, v) for k, v in spec.items()}
    caches = make_caches(model, KVPolicy(**kw, **quant))
    if scheme == "mean":
        for c in caches:
            c.kstore.offset_from = "mean"
    return caches


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
