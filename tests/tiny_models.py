"""Tiny random models for tests: mlx-lm's own model classes built from small configs (a
few hundred kilobytes of float32 weights), in memory or saved as a model folder that mlxkv
loads like any other."""

from __future__ import annotations

import itertools
import json
import re
import shutil
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.utils import _get_classes, save_model

# One config per mlx-lm family (derived from mlx-lm's own tests): tests/test_memory_exact.py
# runs them all.
FAMILIES = json.loads(
    (Path(__file__).parent / "data" / "configs" / "tiny_families.json").read_text()
)["families"]


def tiny_llama(
    seed: int = 0,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 64,
    rope_scaling: dict | None = None,
    rope_theta: float = 10000.0,
    max_position_embeddings: int | None = None,
):
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=heads,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        num_key_value_heads=kv_heads,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_position_embeddings,
    )
    model = llama.Model(args)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def build_family(name: str, seed: int = 0, **overrides):
    """The family ``name`` of FAMILIES (with ``overrides``), its parameters evaluated.

    Seeded: the weights are the same whatever ran before in the worker, so a test's
    numbers (a key element rounding to the next quantization level, say) do not depend on
    which tests ran first."""
    mx.random.seed(seed)
    cfg = dict(FAMILIES[name], **overrides)
    Model, Args = _get_classes(cfg)
    model = Model(Args.from_dict(cfg))
    mx.eval(model.parameters())
    return model


# Architectures whose caches differ (hybrid, windowed, KV-shared, ...), smaller still.
BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=32,
    rope_theta=10000.0,
)
CONFIGS = {
    "mamba": dict(
        model_type="mamba",
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        state_size=4,
        num_hidden_layers=2,
        conv_kernel=4,
        use_bias=False,
        use_conv_bias=True,
        time_step_rank=4,
    ),
    "deepseek_v3": dict(
        BASE,
        model_type="deepseek_v3",
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=16,
        v_head_dim=16,
        qk_nope_head_dim=16,
        first_k_dense_replace=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        max_position_embeddings=256,
    ),
    "gpt_oss": dict(
        BASE,
        model_type="gpt_oss",
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "lfm2": dict(
        BASE,
        model_type="lfm2",
        max_position_embeddings=256,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=64,
        block_ff_dim=128,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        full_attn_idxs=[1],
        layer_types=["conv", "full_attention"],
    ),
    "llama_sliding": dict(
        BASE,
        model_type="llama",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
    ),
    "llama_dynamic": dict(
        BASE,
        model_type="llama",
        rope_scaling={"type": "dynamic", "factor": 2.0},
        max_position_embeddings=64,
    ),
    "smollm3": dict(BASE, model_type="smollm3", no_rope_layer_interval=2),
}


def build(name):
    cfg = CONFIGS[name]
    Model, Args = _get_classes(cfg)
    mx.random.seed(0)
    model = Model(Args.from_dict(cfg))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def model_folder(out: Path, cfg: dict, tokenizer_from: Path, seed: int = 0) -> Path:
    """A random model of ``cfg`` saved in ``out`` (weights and config.json) with the
    tokenizer files of the model folder ``tokenizer_from``."""
    mx.random.seed(seed)
    Model, Args = _get_classes(cfg)
    save_model(out, Model(Args.from_dict(cfg)))
    (out / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, out / name)
    return out


def _byte_chars() -> dict[int, str]:
    """Byte-level BPE's byte -> vocabulary character map (GPT-2's ``bytes_to_unicode``)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {b: chr(b) for b in kept}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _distinct_ids(text: str, vocab: dict[str, int], taken: set[int]) -> list[int]:
    """Token ids that decode to ``text`` with no id used twice (nor one of ``taken``)."""
    chars = _byte_chars()
    s = "".join(chars[b] for b in text.encode())
    out: list[int] = []

    def go(i: int) -> bool:
        if i == len(s):
            return True
        for k in range(min(16, len(s) - i), 0, -1):
            tid = vocab.get(s[i : i + k])
            if tid is None or tid in taken:
                continue
            taken.add(tid)
            out.append(tid)
            if go(i + k):
                return True
            taken.discard(tid)
            out.pop()
        return False

    if not go(0):
        raise ValueError(f"no token path through {text!r} uses each token once")
    return out


def scripted_model(
    out: Path, tokenizer_from: Path, script: str, chat_template: str, added: tuple = ()
) -> list[int]:
    """A one-layer llama saved in ``out`` that answers ``script`` (then its EOS) to every
    chat prompt, greedy or sampled: what a test needs to see a real model write a given
    answer (a tool call) through the whole engine and server.

    Its attention and MLP write nothing, so the last layer sees only the current token's
    embedding, and the output head maps each token of the script (embedded one-hot) to the
    next: a bigram chain, so every token of it must be distinct. ``added`` tokens (tool-call
    markers, as Qwen's tokenizers have them) are added to the tokenizer of
    ``tokenizer_from``, which is saved with ``chat_template``. Returns the script's ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_from))
    tok.add_tokens(list(added))
    tok.chat_template = chat_template
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    hi = [{"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(hi, add_generation_prompt=True, tokenize=False)
    start = tok.encode(prompt, add_special_tokens=False)[-1]  # the generation prompt's last
    eos = tok.eos_token_id
    vocab = tok.get_vocab()
    taken = {start, eos}
    ids: list[int] = []
    for piece in (
        re.split("(" + "|".join(map(re.escape, added)) + ")", script) if added else [script]
    ):
        if piece in added:
            assert vocab[piece] not in taken, piece
            taken.add(vocab[piece])
            ids.append(vocab[piece])
        elif piece:
            ids += _distinct_ids(piece, vocab, taken)
    chain = [start, *ids, eos]
    hidden = 64
    assert len(chain) <= hidden, "script too long for the model's width"
    cfg = dict(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=1,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=len(tok),
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    embed = mx.zeros((len(tok), hidden))
    head = mx.zeros((len(tok), hidden))
    for k, (tid, nxt) in enumerate(itertools.pairwise(chain)):
        embed[tid, k] = 1.0
        head[nxt, k] = 10.0  # after the final norm: logit 80 for the next token, 0 for the rest
    layer = model.model.layers[0]
    model.model.embed_tokens.weight = embed
    model.lm_head.weight = head
    layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
    layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    mx.eval(model.parameters())
    save_model(out, model)
    (out / "config.json").write_text(json.dumps(cfg))
    return ids
