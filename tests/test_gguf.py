"""GGUF import: header checks, the tokenizer, the Q/K permutation, a real answer."""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path

import pytest

from mlxkv.errors import UserError
from mlxkv.models.gguf import _unpermute, convert_gguf
from mlxkv.models.gguf_header import read_header
from tests.gguf_files import STR, gguf


def _gguf_bytes(arch: str, tensors: list[tuple[str, tuple[int, ...], int, int]]) -> bytes:
    """tensors: (name, shape as numpy order, ggml type id, data bytes)."""
    return gguf({"general.architecture": (STR, arch)}, tensors)


def test_header_of_the_default_model(default_gguf):
    h = read_header(default_gguf)
    assert h.metadata["general.architecture"] == "llama"
    assert len(h.tensors) == 272
    assert {t.type_name for t in h.tensors} == {"F32", "Q4_1", "Q8_0"}
    q = next(t for t in h.tensors if t.name == "blk.0.attn_q.weight")
    assert q.shape == (576, 576) and q.type_name == "Q4_1"


def test_truncated_gguf_is_refused_and_leaves_nothing(default_gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(default_gguf.read_bytes()[:50_000_000])
    out = tmp_path / "models" / "cut"
    with pytest.raises(UserError, match="truncated"):
        convert_gguf(cut, out)
    assert not out.exists()
    assert list((tmp_path / "models").glob("*")) == [] if (tmp_path / "models").exists() else True


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04 not gguf at all")
    with pytest.raises(UserError, match="not a GGUF file"):
        convert_gguf(bad, tmp_path / "out")


def test_unsupported_tensor_type_names_the_supported_ones(tmp_path):
    f = tmp_path / "k.gguf"
    f.write_bytes(_gguf_bytes("llama", [("token_embd.weight", (8, 256), 12, 8 * 144)]))
    with pytest.raises(UserError) as e:
        convert_gguf(f, tmp_path / "out")
    assert "Q4_K" in str(e.value) and "F32, F16, Q4_0, Q4_1, Q8_0" in str(e.value)
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(_gguf_bytes("mamba", [("token_embd.weight", (4, 4), 0, 64)]))
    with pytest.raises(UserError, match="architecture 'mamba' is not supported; supported: llama"):
        convert_gguf(f, tmp_path / "out")


def test_interrupted_conversion_leaves_no_model(default_gguf, tmp_path, monkeypatch):
    import mlx.core as mx

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(mx, "save_safetensors", boom)
    out = tmp_path / "models" / "m"
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(default_gguf, out)
    assert not out.exists()
    assert list(out.parent.iterdir()) == []


def test_unpermute_inverts_llama_cpp_permutation():
    import mlx.core as mx

    n_heads, head_dim, cols = 3, 8, 5
    w = mx.arange(n_heads * head_dim * cols).reshape(n_heads * head_dim, cols)
    # llama.cpp's convert: reshape(n_head, 2, hd/2, ...).swapaxes(1, 2)
    permuted = w.reshape(n_heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert mx.array_equal(_unpermute(permuted, n_heads), w)


# -- the tokenizer against the GGUF vocabulary ---------------------------------------------

STRINGS = [
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "  leading and   multiple    spaces\tand\ttabs\n\nnew lines  ",
    "naïve café, Zürich, Ελληνικά, 日本語のテキスト, emoji 🙂👍🏽",
    "<|im_start|>user\nWhat is 12+30?<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # square\n",
    "don't won't it's y'all I'm we've they'll",
]


@cache
def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _reference_bpe(text: str, vocab: dict, ranks: dict, specials: list[str]) -> list[int]:
    """A slow, independent GPT-2 byte-level BPE with SmolLM's single-digit split."""
    import regex

    pat = regex.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    )
    special_re = "(" + "|".join(map(regex.escape, specials)) + ")"
    ids = []
    for part in regex.split(special_re, text):
        if part in specials:
            ids.append(vocab[part])
            continue
        for piece in regex.split(r"(\d)", part):  # Digits(individual_digits=True)
            for word in pat.findall(piece):
                symbols = [_bytes_to_unicode()[b] for b in word.encode()]
                while len(symbols) > 1:
                    pairs = [
                        (ranks.get((a, b), math.inf), i)
                        for i, (a, b) in enumerate(zip(symbols, symbols[1:], strict=False))
                    ]
                    rank, i = min(pairs)
                    if rank == math.inf:
                        break
                    symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
                ids += [vocab[s] for s in symbols]
    return ids


@pytest.mark.model
def test_tokenizer_matches_reference_bpe_and_round_trips(default_model_path):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    data = json.loads((default_model_path / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    ranks = {tuple(m): i for i, m in enumerate(data["model"]["merges"])}
    specials = [t["content"] for t in data["added_tokens"]]
    assert len(vocab) == 49152 and len(ranks) == 48900
    tok = load_tokenizer(default_model_path)
    for text in STRINGS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == _reference_bpe(text, vocab, ranks, specials), text
        assert tok.decode(ids) == text
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert tok.encode("2024", add_special_tokens=False) == [vocab[d] for d in "2024"]


# -- the converted model ---------------------------------------------------------------------

TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife. However little known the feelings or views of such "
    "a man may be on his first entering a neighbourhood, this truth is so well fixed in the "
    "minds of the surrounding families, that he is considered the rightful property of some "
    "one or other of their daughters."
)


def _perplexity(model, tokenizer) -> float:
    import mlx.core as mx
    import mlx.nn as nn

    ids = mx.array(tokenizer.encode(TEXT))[None]
    logits = model(ids[:, :-1])
    loss = nn.losses.cross_entropy(logits.astype(mx.float32), ids[:, 1:]).mean()
    return math.exp(loss.item())


@pytest.mark.model
def test_qk_permutation_is_undone(default_model):
    """Re-applying llama.cpp's permutation to Q and K must wreck the perplexity."""
    import mlx.core as mx

    good = _perplexity(default_model.model, default_model.tokenizer)
    assert good < 40
    layers = default_model.model.model.layers
    saved = [(layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight) for layer in layers]

    def permute(w, n):
        hd = w.shape[0] // n
        return w.reshape(n, 2, hd // 2, -1).swapaxes(1, 2).reshape(w.shape)

    try:
        for layer in layers:
            attn = layer.self_attn
            attn.q_proj.weight = permute(attn.q_proj.weight, 9)
            attn.k_proj.weight = permute(attn.k_proj.weight, 3)
        bad = _perplexity(default_model.model, default_model.tokenizer)
    finally:
        for layer, (q, k) in zip(layers, saved, strict=True):
            layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight = q, k
    mx.eval(default_model.model.parameters())
    assert bad > 3 * good


@pytest.mark.model
def test_converted_config_and_quantization_are_lossless(default_gguf, default_model_path):
    import mlx.core as mx

    config = json.loads((default_model_path / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["num_key_value_heads"] == 3
    assert config["tie_word_embeddings"] is True and config["rope_theta"] == 100000.0
    gguf = mx.load(str(default_gguf))
    mine = mx.load(str(default_model_path / "model.safetensors"))
    # An un-permuted tensor (V) is copied bit for bit, weights, scales and biases.
    for part in ("weight", "scales", "biases"):
        assert mx.array_equal(
            gguf[f"blk.5.attn_v.{part}"], mine[f"model.layers.5.self_attn.v_proj.{part}"]
        )


def test_gguf_path_argument_is_converted_once(default_gguf, tmp_path, monkeypatch):
    from mlxkv.models import resolve as r

    monkeypatch.setenv("MLXKV_HOME", str(tmp_path))
    first = r.resolve(str(default_gguf))
    assert (first.path / "config.json").is_file()
    stamp = (first.path / "model.safetensors").stat().st_mtime_ns
    again = r.resolve(str(default_gguf))
    assert again.path == first.path
    assert (again.path / "model.safetensors").stat().st_mtime_ns == stamp
    assert Path(first.path).parent == tmp_path / "models"


def test_conversion_cache_is_keyed_on_content(default_gguf, tmp_path, monkeypatch):
    """Two files with one name and one size but different weights are two conversions."""
    from mlxkv.models import resolve as r

    monkeypatch.setenv("MLXKV_HOME", str(tmp_path / "home"))
    data = default_gguf.read_bytes()
    a, b, c = (tmp_path / d / "model.gguf" for d in "abc")
    for p in (a, b, c):
        p.parent.mkdir()
    a.write_bytes(data)
    b.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # the last weight byte differs
    c.write_bytes(data)  # same content, another folder
    assert r.gguf_content_key(a) != r.gguf_content_key(b)
    assert r.gguf_content_key(a) == r.gguf_content_key(c)

    converted = []

    def fake_convert(path, out, content_key=None):
        converted.append(out)
        out.mkdir(parents=True)
        (out / "mlxkv_source.json").write_text(json.dumps({"content": content_key}))
        return out

    monkeypatch.setattr("mlxkv.models.gguf.convert_gguf", fake_convert)
    first, second, third = r._gguf(a), r._gguf(b), r._gguf(c)
    assert first.path != second.path and first.path == third.path
    assert converted == [first.path, second.path]  # c reused a's conversion
