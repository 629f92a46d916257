"""Crafted GGUF files for the importer's tests: a one-layer llama (base_meta, base_tensors)
to edit one thing at a time, written by ``gguf``."""

from __future__ import annotations

import math
import struct

U32, I32, F32, BOOL, STR, ARR, U64 = 4, 5, 6, 7, 8, 9, 10

HIDDEN, HEADS, KV, HEAD_DIM, FFN = 8, 2, 1, 4, 16
TOKENS = ["a", "b", "ab", "<s>", "</s>"]


def _s(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def _value(vtype: int, v) -> bytes:
    if vtype == STR:
        return _s(v)
    if vtype == ARR:
        item_type, items = v
        out = struct.pack("<IQ", item_type, len(items))
        return out + b"".join(_value(item_type, x) for x in items)
    return struct.pack("<" + {U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q"}[vtype], v)


def base_meta() -> dict:
    a = "llama"
    return {
        "general.architecture": (STR, "llama"),
        f"{a}.block_count": (U32, 1),
        f"{a}.context_length": (U32, 64),
        f"{a}.embedding_length": (U32, HIDDEN),
        f"{a}.feed_forward_length": (U32, FFN),
        f"{a}.attention.head_count": (U32, HEADS),
        f"{a}.attention.head_count_kv": (U32, KV),
        f"{a}.rope.dimension_count": (U32, HEAD_DIM),
        f"{a}.attention.layer_norm_rms_epsilon": (F32, 1e-5),
        "tokenizer.ggml.model": (STR, "gpt2"),
        "tokenizer.ggml.tokens": (ARR, (STR, TOKENS)),
        "tokenizer.ggml.token_type": (ARR, (I32, [1, 1, 1, 3, 3])),
        "tokenizer.ggml.merges": (ARR, (STR, ["a b"])),
        "tokenizer.ggml.bos_token_id": (U32, 3),
        "tokenizer.ggml.eos_token_id": (U32, 4),
        "tokenizer.chat_template": (STR, "{{ messages[0]['content'] }}"),
    }


def base_tensors() -> list:
    t = [("token_embd.weight", (len(TOKENS), HIDDEN)), ("output_norm.weight", (HIDDEN,))]
    for name, shape in {
        "attn_q": (HEADS * HEAD_DIM, HIDDEN),
        "attn_k": (KV * HEAD_DIM, HIDDEN),
        "attn_v": (KV * HEAD_DIM, HIDDEN),
        "attn_output": (HIDDEN, HEADS * HEAD_DIM),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
        "attn_norm": (HIDDEN,),
        "ffn_norm": (HIDDEN,),
    }.items():
        t.append((f"blk.0.{name}.weight", shape))
    return t


def gguf(meta: dict, tensors: list, align: int = 32, stacked: bool = False) -> bytes:
    """A GGUF file whose tensors are all zeros: ``(name, shape)`` for F32, or ``(name, shape,
    ggml type id, data bytes)``; shapes in numpy order. ``stacked``: every tensor's data
    starts at offset 0 (a crafted file naming the same bytes many times)."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta))
    for key, (vtype, v) in meta.items():
        out += _s(key) + struct.pack("<I", vtype) + _value(vtype, v)
    offset = end = 0
    for name, shape, *typed in tensors:
        type_id, n = typed or (0, 4 * math.prod(shape))
        out += _s(name) + struct.pack("<I", len(shape))
        out += b"".join(struct.pack("<Q", d) for d in reversed(shape))
        out += struct.pack("<IQ", type_id, offset)
        end = max(end, offset + (n + 31) // 32 * 32)
        offset = 0 if stacked else end
    out += b"\0" * (-len(out) % max(align, 1))
    return out + b"\0" * end
