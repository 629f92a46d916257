"""Slow references for the cache tests: explicit attention over the kept tokens.

``reference_logits`` runs an mlx-lm llama-family model without any cache: for every query
``t`` and layer it gathers the tokens a policy keeps for ``t`` and recomputes attention
with explicit positions. ``frame="within"`` is StreamingLLM's definition (keys at their
index within the kept set, query at the last index) and knows nothing of the sink-rotation
trick. ``frame="absolute"`` rotates window keys at their absolute positions and sinks at
``j + D`` (D = evicted tokens), rotating the stored sink keys by D like the cache does, so
quantized keys see the same numbers before quantization (quantization does not commute
with rotation); positions are the same distances.
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv.caches.rotation import rotation_of


def kept_indices(t: int, sinks: int, window: int | None) -> list[int]:
    if window is None or t < sinks + window:
        return list(range(t + 1))
    return list(range(sinks)) + list(range(t - window + 1, t + 1))


def quantize_dequantize(x, bits, group_size):
    if bits is None:
        return x
    return mx.dequantize(*mx.quantize(x, group_size=group_size, bits=bits), group_size, bits)


def _hadamard(x):
    n = x.shape[-1]
    h = mx.array([[1.0]])
    while h.shape[0] < n:  # Sylvester's construction, written out (not mx.hadamard_transform)
        h = mx.concatenate(
            [mx.concatenate([h, h], axis=1), mx.concatenate([h, -h], axis=1)], axis=0
        )
    return x @ (h / n**0.5).astype(x.dtype)


def quantized_frame(kk, qq, vv, offset, policy):
    """Keys, query and values as a quantized policy's cache gives them to attention: keys
    minus ``offset`` (the first token's key), Hadamard-rotated, quantized and dequantized per
    token; the query rotated alike (``rotated`` scheme); values quantized per token."""
    if policy is None or policy.bits is None:
        return kk, qq, vv
    if policy.key_bits is not None and policy.key_scheme == "rotated":
        kk, qq = _hadamard(kk - offset), _hadamard(qq)
    kk = quantize_dequantize(kk, policy.key_bits, policy.group_size)
    return kk, qq, quantize_dequantize(vv, policy.value_bits, policy.value_group_size)


def kivi_groups(k: mx.array, sinks: int, group_size: int, bits: int) -> mx.array:
    """Keys (B, H, T, D) with every complete group of ``group_size`` ring tokens (tokens
    ``sinks..``, groups fixed by the token index) quantized and dequantized per channel
    along the tokens; sinks and the incomplete last group as they were."""
    T = k.shape[2]
    done = (T - sinks) // group_size * group_size if T > sinks else 0
    if not done:
        return k
    ring = k[:, :, sinks : sinks + done, :].swapaxes(-1, -2)
    ring = quantize_dequantize(ring, bits, group_size).swapaxes(-1, -2)
    return mx.concatenate([k[:, :, :sinks, :], ring, k[:, :, sinks + done :, :]], axis=2)


def kivi_keys(k_abs, kq, t: int, idx: list[int], sinks: int, group_size: int) -> mx.array:
    """The keys a KIVI cache gives query ``t`` for token indices ``idx`` (window tokens):
    tokens of earlier groups from ``kq`` (quantized), its own group from ``k_abs``."""
    own = (t - sinks) // group_size
    cols = [
        kq[:, :, k : k + 1, :] if (k - sinks) // group_size < own else k_abs[:, :, k : k + 1, :]
        for k in idx
    ]
    return mx.concatenate(cols, axis=2)


def feed(model, tokens, caches, chunks) -> mx.array:
    """Logits for ``tokens`` fed through ``caches`` in the given chunk sizes."""
    tokens = mx.array(tokens)
    outs, p = [], 0
    for c in chunks:
        out = model(tokens[None, p : p + c], cache=caches)
        mx.eval(out)
        outs.append(out)
        p += c
    assert p == tokens.size
    return mx.concatenate(outs, axis=1)


def reference_logits(
    model,
    tokens,
    sinks: int = 0,
    window: int | None = None,
    bits: int | None = None,
    group_size: int = 64,
    frame: str = "within",
    policy=None,
) -> mx.array:
    """``bits``/``group_size``: plain per-token quantization of keys and values; ``policy``:
    a quantized ``KVPolicy``'s scheme instead (see :func:`quantized_frame`)."""
    inner = model.model
    h = inner.embed_tokens(mx.array(tokens)[None])
    T = h.shape[1]
    for layer in inner.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        B, L, _ = x.shape
        q = attn.q_proj(x).reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3)
        k = attn.k_proj(x).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = attn.v_proj(x).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        rep = attn.n_heads // attn.n_kv_heads
        k_abs = attn.rope(k)
        rot = rotation_of(attn.rope)
        kivi = policy is not None and policy.key_bits is not None and policy.key_scheme == "kivi"
        if kivi:
            kq = kivi_groups(k_abs, sinks, policy.group_size, policy.key_bits)
        outs = []
        for t in range(T):
            idx = kept_indices(t, sinks, window)
            n = len(idx)
            if frame == "within":
                kk = attn.rope(k[:, :, idx, :])
                qq = attn.rope(q[:, :, t : t + 1, :], offset=n - 1)
            else:
                d = 0 if window is None else max(0, t + 1 - sinks - window)
                parts = []
                if sinks and d:
                    parts.append(rot.shift(k_abs[:, :, :sinks, :], d))
                    idx_w = idx[sinks:]
                else:
                    idx_w = idx
                if kivi:  # sinks stay in full precision
                    if not (sinks and d):
                        parts.append(k_abs[:, :, : min(sinks, len(idx_w)), :])
                        idx_w = [i for i in idx_w if i >= sinks]
                    if idx_w:
                        parts.append(kivi_keys(k_abs, kq, t, idx_w, sinks, policy.group_size))
                else:
                    parts.append(k_abs[:, :, idx_w, :])
                kk = mx.concatenate(parts, axis=2)
                qq = attn.rope(q[:, :, t : t + 1, :], offset=t)
            if kivi:
                vv = quantize_dequantize(
                    v[:, :, idx, :], policy.value_bits, policy.value_group_size
                )
            elif policy is not None:
                kk, qq, vv = quantized_frame(kk, qq, v[:, :, idx, :], k_abs[:, :, :1, :], policy)
            else:
                kk = quantize_dequantize(kk, bits, group_size)
                vv = quantize_dequantize(v[:, :, idx, :], bits, group_size)
            if rep > 1:
                kk = mx.repeat(kk, rep, axis=1)
                vv = mx.repeat(vv, rep, axis=1)
            s = (qq * attn.scale) @ kk.swapaxes(-1, -2)
            outs.append(mx.softmax(s, axis=-1, precise=True) @ vv)
        o = mx.concatenate(outs, axis=2).transpose(0, 2, 1, 3).reshape(B, L, -1)
        h = h + attn.o_proj(o)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        mx.eval(h)
    h = inner.norm(h)
    if model.args.tie_word_embeddings:
        return inner.embed_tokens.as_linear(h)
    return model.lm_head(h)


class LiteralStreamingCache:
    """StreamingLLM as published, one token at a time: keys are kept *un-rotated* and the
    whole cache is re-rotated at positions 0..n-1 on every step; the query sits at n-1.
    It knows nothing of sink shifting or rebasing (a cache-protocol reference for greedy
    decoding). ``rope`` is the layer's RoPE module."""

    def __init__(self, sinks: int, window: int, rope):
        self.S, self.W, self.rope = sinks, window, rope
        self.raw_k = self.v = None

    @property
    def offset(self) -> int:  # within-cache position of the next token
        n = 0 if self.raw_k is None else self.raw_k.shape[2]
        return min(n, self.S + self.W - 1)

    def make_mask(self, N, window_size=None, return_array=False):
        assert N == 1, "the literal reference decodes one token at a time"
        return None

    def update_and_fetch(self, keys, values):
        raw = self.rope(keys, offset=-self.offset)  # undo the model's rotation
        if self.raw_k is None:
            self.raw_k, self.v = raw, values
        else:
            self.raw_k = mx.concatenate([self.raw_k, raw], axis=2)
            self.v = mx.concatenate([self.v, values], axis=2)
        if self.raw_k.shape[2] > self.S + self.W:  # evict the oldest window token
            keep = list(range(self.S)) + list(range(self.S + 1, self.raw_k.shape[2]))
            self.raw_k, self.v = self.raw_k[:, :, keep], self.v[:, :, keep]
        return self.rope(self.raw_k), self.v


def greedy(model, prompt, caches, steps: int, prefill_chunks=None) -> list[int]:
    """Greedy token ids after ``prompt`` (prefilled in ``prefill_chunks``, default 1 by 1)."""
    chunks = prefill_chunks or [1] * len(prompt)
    logits = feed(model, prompt, caches, chunks)[:, -1]
    out = []
    for _ in range(steps):
        y = mx.argmax(logits, axis=-1)
        mx.eval(y)
        out.append(y.item())
        logits = model(y[None], cache=caches)[:, -1]
    return out


def gpu_rule(model, group_size: int = 32):
    """``model`` as a GPU runs it (docs/gpu.md): linear and embedding layers packed to 4 bits,
    every other floating parameter, and so activations and KV, in bfloat16."""
    import mlx.nn as nn

    nn.quantize(model, group_size=group_size, bits=4)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model
