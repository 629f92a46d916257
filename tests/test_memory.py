"""Memory model on published configs (bytes/token derived by hand), formulas, predictor,
weights, system probe. Byte-exactness against real caches is in test_memory_exact.py."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from mlxkv.memory.config import BadInput, load_config
from mlxkv.memory.layout import Layout
from mlxkv.memory.predictor import KVPredictor, predict, prefill_schedule
from mlxkv.policy import KVPolicy

PUBLISHED = Path(__file__).parent / "data" / "configs" / "published"


pytestmark = pytest.mark.usefixtures("fresh_home")


def _layout(name: str) -> Layout:
    from mlxkv.memory.probe import probe

    return probe(load_config(PUBLISHED / name))


def _per_token(layout: Layout, dtype: str, **where) -> int:
    """Bytes per token summed over the caches matching ``where`` (cls=..., role=...)."""
    specs = [p for p in layout.specs() if all(getattr(p, k) == v for k, v in where.items())]
    return sum(p.bytes_per_token(dtype) for p in specs)


# --- published configs: bytes per token derived by hand --------------------------------


def test_llama2_7b():
    # MHA: 2 (K,V) x 32 layers x 32 KV heads x 128 head_dim x 2 B (fp16) = 524,288 B/token
    lay = _layout("llama-2-7b.json")
    assert len(lay.layers) == 32
    assert _per_token(lay, "float16") == 2 * 32 * 32 * 128 * 2 == 524_288


def test_llama3_8b_and_mistral_7b():
    # GQA: 2 x 32 layers x 8 KV heads x 128 x 2 B = 131,072 B/token (not 65,536 or 409,600)
    for name in ("llama-3-8b.json", "mistral-7b-v0.1.json"):
        lay = _layout(name)
        assert _per_token(lay, "bfloat16") == 2 * 32 * 8 * 128 * 2 == 131_072
        # Mistral's config declares sliding_window 4096, but mlx-lm (llama.py) keeps full
        # caches on every layer: we predict what the runtime builds.
        assert all(p.cls == "KVCache" for p in lay.specs())
    assert _layout("mistral-7b-v0.1.json").facts.declared_window == 4096


def test_qwen25_7b():
    # 2 x 28 layers x 4 KV heads x 128 (3584 / 28) x 2 B = 57,344 B/token
    lay = _layout("qwen2.5-7b-instruct.json")
    assert _per_token(lay, "bfloat16") == 2 * 28 * 4 * 128 * 2 == 57_344


def test_gemma3_4b_nested_text_config():
    # text_config: 34 layers, every 6th global (i % 6 == 5: 5 layers), 29 sliding (1024).
    # Per layer: 2 x 4 KV heads x 256 x 2 B = 4,096 B/token.
    lay = _layout("gemma-3-4b-it.json")
    assert _per_token(lay, "bfloat16", cls="KVCache") == 5 * 4096
    sliding = [p for p in lay.specs() if p.cls == "RotatingKVCache"]
    assert len(sliding) == 29 and {p.window for p in sliding} == {1024}
    # At 32k tokens the sliding layers hold 1024 tokens, the global ones all 32k.
    kv = predict(lay, 32768, kv_dtype="bfloat16", chunk=512)
    assert kv.logical == 5 * 4096 * 32768 + 29 * 4096 * 1024


def test_deepseek_v3_mla_is_per_layer():
    # MLA: the latent (kv_lora_rank 512) as keys, the decoupled RoPE key (64) as values,
    # one head, in EVERY layer: 61 x (512 + 64) x 2 B = 70,272 B/token (not 1,152).
    lay = _layout("deepseek-v3.json")
    assert {(p.role, p.kv_heads, p.k_head_dim, p.v_head_dim) for p in lay.specs()} == {
        ("mla", 1, 512, 64)
    }
    assert _per_token(lay, "bfloat16") == 61 * (512 + 64) * 2 == 70_272
    # All 256 routed experts are resident: ~671B parameters (MTP layer not loaded by mlx-lm).
    assert 670e9 < lay.facts.dense_params < 672e9


def test_gpt_oss_20b():
    # 24 layers alternating sliding (128) / full; per layer 2 x 8 x 64 x 2 B = 2,048 B/token.
    lay = _layout("gpt-oss-20b.json")
    full = [p for p in lay.specs() if p.cls == "KVCache"]
    sliding = [p for p in lay.specs() if p.cls == "RotatingKVCache"]
    assert len(full) == len(sliding) == 12 and {p.window for p in sliding} == {128}
    assert _per_token(lay, "bfloat16") == 24 * 2048 == 49_152
    # mxfp4 experts stay packed (Metal): far below 21B x 2 bytes.
    assert lay.facts.quantized and lay.facts.fixed_param_bytes > 0


def test_mamba_state_is_not_state_size_times_layers():
    # Per layer: conv state (conv_kernel - 1) x d_inner = 3 x 1536, SSM state
    # d_inner x state_size = 1536 x 16; fp32: (4,608 + 24,576) x 4 = 116,736 B, x 24 layers.
    lay = _layout("mamba-130m.json")
    assert _per_token(lay, "float32") == 0
    assert sum(p.state_bytes("float32") for p in lay.specs()) == 24 * 116_736
    kv = predict(lay, 100_000, batch=3)
    assert kv.logical == kv.allocated == 3 * 24 * 116_736


# --- formulas ----------------------------------------------------------------------------


def test_quantized_kv_is_not_a_flat_fraction():
    # 4-bit, group 64, fp16 scales+biases: (64 + 2*2*2) / 256 = 0.28x; 8-bit: 0.53x
    lay = _layout("llama-3-8b.json")
    full = predict(lay, 4096, kv_dtype="float16").logical
    q4 = predict(lay, 4096, KVPolicy(bits=4, group_size=64), kv_dtype="float16").logical
    q8 = predict(lay, 4096, KVPolicy(bits=8, group_size=64), kv_dtype="float16").logical
    assert q4 * 256 == full * 72 and q8 * 256 == full * 136


def test_sinks_add_tokens_to_the_window():
    lay = _layout("llama-3-8b.json")
    kv = predict(lay, 10_000, KVPolicy(window=1024, sinks=4), kv_dtype="float16")
    assert kv.kept_tokens == 1028 and kv.evicted_tokens == 10_000 - 1028
    assert kv.logical == 1028 * 131_072


def test_predictor_is_incremental_and_grouped():
    lay = _layout("deepseek-v3.json")
    p = KVPredictor(lay, batch=2, kv_dtype="bfloat16")
    assert len(p._groups) == 1  # 61 identical layers: one step costs one group update
    for n in prefill_schedule(1000, 300):
        p.advance(n)
    assert p.snapshot() == predict(lay, 1000, batch=2, kv_dtype="bfloat16", chunk=300)
    for _ in range(24):
        p.advance(1)
    assert p.tokens_seen == 1024 and p.snapshot().logical == 2 * 1024 * 70_272
    with pytest.raises(ValueError):
        p.advance(0)


def test_layout_round_trips_through_json():
    lay = _layout("gemma-3-4b-it.json")
    assert Layout.from_dict(json.loads(json.dumps(lay.to_dict()))) == lay


def test_layout_store_skips_the_probe_second_time(monkeypatch):
    from mlxkv.memory import probe as probe_mod
    from mlxkv.memory.store import layout_for

    cfg = load_config(PUBLISHED / "qwen2.5-7b-instruct.json")
    first = layout_for(cfg)
    monkeypatch.setattr(probe_mod, "probe", lambda c: pytest.fail("probed again"))
    assert layout_for(cfg) == first


# --- weights -----------------------------------------------------------------------------


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]):
    header, offset = {}, 0
    sizes = {"F32": 4, "BF16": 2, "F16": 2, "U32": 4}
    for name, (dt, shape) in tensors.items():
        n = sizes[dt]
        for d in shape:
            n *= d
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def test_weights_from_safetensors_headers(tmp_path):
    from mlxkv.memory.weights import from_local

    # A 4-bit layer (packed 8 per uint32, group 64) and a bf16 norm.
    _write_safetensors(
        tmp_path / "model.safetensors",
        {
            "layers.0.q.weight": ("U32", [256, 32]),
            "layers.0.q.scales": ("BF16", [256, 4]),
            "layers.0.q.biases": ("BF16", [256, 4]),
            "norm.weight": ("BF16", [256]),
        },
    )
    cfg = {"quantization": {"bits": 4, "group_size": 64}}
    packed = from_local(tmp_path, cfg, "bfloat16", dequantize=False)
    assert packed.bytes == 256 * 32 * 4 + 2 * 256 * 4 * 2 + 256 * 2 == packed.file_bytes
    assert packed.params == 256 * 256 + 256
    plain = from_local(tmp_path, cfg, "float32", dequantize=True)  # the CPU engine
    assert plain.bytes == (256 * 256 + 256) * 4
    assert "safetensors headers" in plain.source


def test_weights_from_config_count():
    from mlxkv.memory.weights import from_layout

    lay = _layout("llama-3-8b.json")
    w = from_layout(lay.facts, "bfloat16", dequantize=False)
    assert w.params == 8_030_261_248 and w.bytes == 2 * w.params  # Llama-3-8B: 8.03B
    assert "parameter count" in w.source


def test_gemma3_tied_head_counted_once():
    """mlx-lm's Gemma 3 builds an lm_head and drops it while loading a checkpoint that has
    none, as the published ones do: the plan counts the embedding table once."""
    from mlxkv.memory.probe import probe
    from mlxkv.memory.weights import from_layout

    lay = _layout("gemma-3-4b-it.json")  # the language model of Gemma 3 4B: 3.88B
    assert from_layout(lay.facts, "bfloat16", dequantize=False).params == 3_880_263_168
    untied = probe(dict(load_config(PUBLISHED / "gemma-3-4b-it.json"), tie_word_embeddings=False))
    assert untied.facts.dense_params - lay.facts.dense_params == 262_208 * 2_560  # the head


# --- system ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [("16GB", 16 * 10**9), ("16GiB", 16 * 2**30), ("512M", 512 * 10**6), ("1.5G", 1.5e9)],
)
def test_parse_size(text, expected):
    from mlxkv.memory.system import parse_size

    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "16 parsecs", "-1G", "0", "GB"])
def test_parse_size_rejects(text):
    from mlxkv.memory.system import parse_size

    with pytest.raises(BadInput):
        parse_size(text)


def test_system_memory_on_this_machine():
    from mlxkv.memory.system import system_memory

    mem = system_memory()
    assert mem.available > 0 and mem.source
    assert system_memory("2GiB").available == 2 * 2**30


def test_default_kv_dtype_follows_the_engine():
    from mlxkv.memory.dtypes import default_kv_dtype

    cfg = {"model_type": "llama", "torch_dtype": "bfloat16"}
    assert default_kv_dtype(cfg, on="cpu") == "float32"
    assert default_kv_dtype(cfg, on="metal") == "bfloat16"
    assert default_kv_dtype({"model_type": "x"}, on="metal") == "float16"


@pytest.mark.model
def test_plan_weights_match_the_loaded_default_model(default_model):
    """The weights the plan predicts from safetensors headers == what the engine holds."""
    from mlxkv.memory.estimate import estimate_model
    from mlxkv.memory.source import from_path

    est = estimate_model(from_path(default_model.path), search=False)
    assert est.budget.weights.bytes == default_model.weights_bytes
    assert est.setting.kv_dtype == default_model.dtype
