"""Convert a llama-family GGUF file into an MLX model folder.

MLX reads Q4_0/Q4_1/Q8_0 tensors as affine quantization with group size 32, so the
weights are repacked losslessly. llama.cpp stores Q and K rows permuted for its RoPE
layout; they are permuted back here (rows only, so quantized tensors stay lossless).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

from mlxkv.errors import UserError
from mlxkv.files import shared_bytes
from mlxkv.memory.config import MAX_LAYERS
from mlxkv.models.gguf_header import GGUFArray, GGUFHeader, check_supported, read_header
from mlxkv.models.gguf_tokenizer import build_tokenizer_files

SUPPORTED_ARCHITECTURES = ("llama",)
GROUP_SIZE = 32  # every GGUF block format MLX imports has 32 elements per block

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _hf_name(name: str) -> str:
    """'blk.3.attn_q.scales' -> 'model.layers.3.self_attn.q_proj.scales'."""
    parts = name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"


def _unpermute(x, n_heads: int):
    """Undo llama.cpp's Q/K row permutation (HF rotate-half layout <- interleaved pairs)."""
    rows = x.shape[0]
    head_dim = rows // n_heads
    return (
        x.reshape(n_heads, head_dim // 2, 2, *x.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows, *x.shape[1:])
    )


def _int(meta: dict, key: str, default=None):
    v = meta.get(key, default)
    if v is None:
        raise UserError(
            f"GGUF metadata is missing '{key}'; the file is incomplete or not a chat model"
        )
    return int(v.item()) if hasattr(v, "item") else int(v)


def _float(meta: dict, key: str, default: float) -> float:
    v = meta.get(key, default)
    return float(v.item()) if hasattr(v, "item") else float(v)


def _llama_config(meta: dict, weights: dict) -> dict:
    a = "llama"
    hidden = _int(meta, f"{a}.embedding_length")
    heads = _int(meta, f"{a}.attention.head_count")
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": _int(meta, f"{a}.block_count"),
        "intermediate_size": _int(meta, f"{a}.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _int(meta, f"{a}.attention.head_count_kv", heads),
        "head_dim": _int(meta, f"{a}.rope.dimension_count", hidden // heads),
        "rms_norm_eps": _float(meta, f"{a}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _float(meta, f"{a}.rope.freq_base", 10000.0),
        "max_position_embeddings": _int(meta, f"{a}.context_length", 4096),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": "output.weight" not in weights,
        "torch_dtype": "float16",
        "bos_token_id": _int(meta, "tokenizer.ggml.bos_token_id", 1),
        "eos_token_id": _int(meta, "tokenizer.ggml.eos_token_id", 2),
    }
    if meta.get(f"{a}.rope.scaling.type") == "linear":
        config["rope_scaling"] = {
            "type": "linear",
            "factor": _float(meta, f"{a}.rope.scaling.factor", 1.0),
        }
    if any(k.endswith(".scales") for k in weights):
        config["quantization"] = {"group_size": GROUP_SIZE, "bits": 4}
    return config


def _bad(path: Path, what: str) -> UserError:
    return UserError(f"{path}: GGUF {what}; the file is corrupt or not a llama chat model")


def check_llama(header: GGUFHeader, path: Path) -> None:
    """Check, from the header alone, every value the conversion and the model will use:
    types, ranges and agreement with the tensor shapes. MLX reads the file only after."""
    meta, a = header.metadata, "llama"

    def pos_int(key: str, default=None, required=True) -> int | None:
        v = meta.get(key, default)
        if v is None and not required:
            return None
        if v is None:
            raise _bad(path, f"metadata is missing '{key}'")
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0 or v > MAX_SIZE:
            raise _bad(path, f"'{key}' must be a positive integer, not {v!r}")
        return v

    def pos_float(key: str) -> None:
        v = meta.get(key)
        if v is not None and (
            isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf
        ):
            raise _bad(path, f"'{key}' must be a positive number, not {v!r}")

    hidden = pos_int(f"{a}.embedding_length")
    heads = pos_int(f"{a}.attention.head_count")
    kv_heads = pos_int(f"{a}.attention.head_count_kv", heads)
    layers = pos_int(f"{a}.block_count")
    pos_int(f"{a}.feed_forward_length")
    pos_int(f"{a}.context_length", 4096)
    head_dim = pos_int(f"{a}.rope.dimension_count", hidden // heads)
    pos_float(f"{a}.attention.layer_norm_rms_epsilon")
    pos_float(f"{a}.rope.freq_base")
    if heads % kv_heads:
        raise _bad(path, f"head_count {heads} is not a multiple of head_count_kv {kv_heads}")
    if layers > MAX_LAYERS:  # refused now, not after gigabytes of conversion
        raise _bad(path, f"block_count is {layers:,}; mlxkv plans models of up to {MAX_LAYERS:,}")
    if head_dim % 2:
        raise _bad(path, f"rope.dimension_count {head_dim} is odd; rotary heads come in halves")
    shared = shared_bytes({t.name: (t.offset, t.offset + t.nbytes) for t in header.tensors})
    if shared:
        raise _bad(path, f"tensors {shared[0]} and {shared[1]} share bytes")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, GGUFArray) or not tokens.of_strings or tokens.n == 0:
        raise _bad(path, "'tokenizer.ggml.tokens' must be a non-empty list of strings")
    n_vocab = tokens.n
    for key, of_ints in (("token_type", True), ("merges", False)):
        v = meta.get(f"tokenizer.ggml.{key}")
        if v is not None and (
            not isinstance(v, GGUFArray) or (v.of_ints if of_ints else v.of_strings) is False
        ):
            raise _bad(path, f"'tokenizer.ggml.{key}' must be a list of "
                       + ("integers" if of_ints else "strings"))  # fmt: skip
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None and types.n != n_vocab:
        raise _bad(path, f"'tokenizer.ggml.token_type' has {types.n} entries for {n_vocab} tokens")
    for key in ("bos", "eos", "unknown", "padding"):
        v = meta.get(f"tokenizer.ggml.{key}_token_id")
        if v is not None and (
            not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < n_vocab
        ):
            raise _bad(path, f"'tokenizer.ggml.{key}_token_id' {v!r} is not a token id "
                       f"(0 to {n_vocab - 1})")  # fmt: skip
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        if key in meta and not isinstance(meta[key], str):
            raise _bad(path, f"'{key}' must be a string")
    blocks = set()
    for t in header.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk":
            if len(parts) != 4 or not parts[1].isdigit() or parts[2] not in _LAYER_NAMES:
                raise _bad(path, f"tensor name {t.name!r} is not a llama layer tensor")
            blocks.add(int(parts[1]))
        elif len(parts) != 2 or parts[0] not in _TOP_NAMES:
            raise _bad(path, f"tensor name {t.name!r} is not a llama tensor")
    if blocks != set(range(layers)):
        raise _bad(path, f"block_count is {layers} but the file holds {len(blocks)} layers")
    want = {
        "token_embd.weight": (n_vocab, hidden),
        "blk.0.attn_q.weight": (heads * head_dim, hidden),
        "blk.0.attn_k.weight": (kv_heads * head_dim, hidden),
    }
    shapes = {t.name: t.shape for t in header.tensors}
    for name, shape in want.items():
        if shapes.get(name) != shape:
            raise _bad(
                path, f"tensor {name} has shape {list(shapes.get(name, ()))}, the metadata "
                f"says {list(shape)}"
            )  # fmt: skip


MAX_SIZE = 1 << 24  # no dimension, count or length of a llama model comes near this

MARKER = "mlxkv_source.json"  # written into every folder a conversion makes


def check_replaceable(out_dir: Path) -> None:
    """Refuse (one line) to replace ``out_dir`` unless it is absent or a real folder that
    an earlier conversion made: mlxkv never removes what it did not create."""
    if out_dir.is_symlink():
        raise UserError(f"{out_dir} is a symbolic link; mlxkv does not replace it: remove the link")
    if out_dir.exists() and not (out_dir.is_dir() and (out_dir / MARKER).is_file()):
        raise UserError(
            f"{out_dir} exists and was not made by mlxkv; move it away (mlxkv never "
            "removes files it did not create)"
        )


def gguf_missing(path: Path) -> str:
    """Why ``path`` (a name ending .gguf that is no regular file) cannot be read."""
    if path.exists():
        return f"{path} is not a regular file; give a .gguf file"
    return f"GGUF file not found: {path}"


def convert_gguf(gguf_path: Path, out_dir: Path, content_key: str | None = None) -> Path:
    """Convert ``gguf_path`` into the MLX model folder ``out_dir`` atomically
    (``content_key``, the source's digest, is recorded in its mlxkv_source.json).

    The folder is written under a temporary name beside ``out_dir`` and renamed at the
    end: an interrupted conversion leaves nothing that looks like a model. One conversion
    into ``out_dir`` runs at a time: a second (two ``mlxkv pull`` at once) waits, then
    finds the folder the first made.
    """
    import fcntl

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    check_replaceable(out_dir)
    if not gguf_path.is_file():
        raise UserError(gguf_missing(gguf_path))
    header = read_header(gguf_path)  # every refusal before anything is written
    check_supported(header, gguf_path, SUPPORTED_ARCHITECTURES)
    check_llama(header, gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    source = {"gguf": gguf_path.name, "size": gguf_path.stat().st_size, "content": content_key}
    folder = os.open(out_dir.parent, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)  # on the models folder: no lock file is left
        if _made_from(out_dir) == source and (out_dir / "config.json").is_file():
            return out_dir  # made while this one waited
        return _convert(gguf_path, out_dir, source)
    finally:
        os.close(folder)  # releases the lock


def _made_from(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _convert(gguf_path: Path, out_dir: Path, source: dict) -> Path:
    import mlx.core as mx

    check_replaceable(out_dir)
    try:
        weights, meta = mx.load(str(gguf_path), return_metadata=True)
    except Exception as e:  # MLX's loader reports corrupt data as a bare runtime error
        raise UserError(f"{gguf_path}: cannot read GGUF tensors ({e}); download it again") from None
    try:
        tokenizer_json, tokenizer_config = build_tokenizer_files(meta)
    except (ValueError, KeyError) as e:
        raise UserError(f"{gguf_path}: unsupported tokenizer: {e}") from None

    config = _llama_config(meta, weights)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    mlx_weights = {}
    for name, w in weights.items():
        kind = name.split(".")[2] if name.startswith("blk.") else None
        if kind in heads:
            w = _unpermute(w, heads[kind])
        mlx_weights[_hf_name(name)] = w

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.parent.glob(f".{out_dir.name}.*.partial"):
        if stale.is_dir() and not stale.is_symlink():  # left by a conversion that was killed
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a model folder is not
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), mlx_weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
        (tmp / MARKER).write_text(json.dumps(source))
        check_replaceable(out_dir)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
