"""Long-stream perplexity per cache policy: the policy names of ``benchmarks/long_ppl.py``
(``full``, ``sink-q4``, ``rotating``, ...), their caches and the per-token negative
log-likelihood of a text fed in chunks. ``mlxkv bench`` scores its streams with the same
counting (tests/test_bench.py)."""

from __future__ import annotations

import math
import re

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
