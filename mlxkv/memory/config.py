"""config.json: read it, check the fields the memory model relies on, expose the text view.

Multimodal configs nest the language model under ``text_config``; the fields that size
the KV cache live there. mlx-lm's ModelArgs take the whole dict, so we keep it whole and
only *read* through the merged text view.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from mlxkv.errors import UserError
from mlxkv.files import parse_json, read_text


class BadInput(UserError):
    """Input the plan cannot use; the message is one line naming the field or file."""


# Fields that must be positive integers when present (top level or text_config).
_POSITIVE_INTS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "intermediate_size",
    "max_position_embeddings",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "num_local_experts",
    "num_experts",
    "attention_chunk_size",
)
# Numbers that must be positive when present (json reads NaN and Infinity, so check finiteness).
_POSITIVE_NUMBERS = ("rope_theta", "rms_norm_eps", "layer_norm_eps", "partial_rotary_factor")
# Windows: null means "no window".
_OPTIONAL_POSITIVE_INTS = ("sliding_window", "sliding_window_size", "attention_window_size")
# Planning builds mlx-lm's model lazily, so its cost grows with the layers (about 4 s for
# 1,000 here); the largest published models have under 200.
MAX_LAYERS = 1024
# mlx-lm builds one module per expert as well (100,000 experts: 4.2 GB and 47 s); the
# largest published models have 512. Every config key that counts layers or experts, in
# whatever spelling a family uses (num_transformer_layers, moe_num_experts, ...), is held
# to these, and every list to MAX_LIST (per-layer lists have one entry per layer).
MAX_EXPERTS = 4096
MAX_LIST = 4 * MAX_LAYERS
_COUNTS = (
    (re.compile(r"(^|_)layers?$"), MAX_LAYERS, "layers", "under 200"),
    (re.compile(r"experts"), MAX_EXPERTS, "experts", "at most 512"),
)


CONFIG_LIMIT = 16 << 20  # bytes; the largest published config.json is under 100 KB


def load_config(path: str | Path) -> dict:
    """Read a config.json file; every failure is a one-line BadInput."""
    p = Path(path)
    try:
        text = read_text(p, CONFIG_LIMIT, "config file")
    except UserError as e:
        raise BadInput(str(e)) from None
    try:
        config = parse_json(text, str(p))
    except UserError as e:
        raise BadInput(str(e)) from None
    if not isinstance(config, dict):
        raise BadInput(f"{p} must hold a JSON object, got {type(config).__name__}")
    return config


def text_view(config: dict) -> dict:
    """Top-level fields overlaid with ``text_config`` (where the language model lives)."""
    text = config.get("text_config")
    if isinstance(text, dict):
        return {**config, **text}
    return config


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _non_finite(value, where: str) -> str | None:
    """The key path of the first NaN or infinity inside ``value``, else None."""
    if isinstance(value, float) and not math.isfinite(value):
        return where
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for k, v in items:
        found = _non_finite(v, f"{where}.{k}" if where else str(k))
        if found:
            return found
    return None


def _check_counts(value, where: str) -> None:
    """Refuse a layer or expert count, or a list, past what mlxkv plans (see MAX_LAYERS)."""
    if isinstance(value, list):
        if len(value) > MAX_LIST:
            raise BadInput(
                f"'{where}' holds {len(value):,} entries; mlxkv plans models whose lists have "
                f"up to {MAX_LIST:,}: fix config.json"
            )
        for i, v in enumerate(value):
            _check_counts(v, f"{where}[{i}]")
        return
    if not isinstance(value, dict):
        return
    for key, v in value.items():
        at = f"{where}.{key}" if where else str(key)
        for pattern, most, what, published in _COUNTS:
            if _is_int(v) and v > most and pattern.search(str(key)):
                raise BadInput(
                    f"'{at}' is {v:,}; mlxkv plans models of up to {most:,} {what} "
                    f"(published models have {published}): fix config.json"
                )
        _check_counts(v, at)


def validate(config: dict) -> str:
    """Check the fields the memory model reads; return the model_type."""
    bad = _non_finite(config, "")
    if bad:
        raise BadInput(f"'{bad}' is not a finite number; fix config.json")
    model_type = config.get("model_type")
    if model_type is None:
        raise BadInput("config.json has no 'model_type' field")
    if not isinstance(model_type, str) or not model_type:
        raise BadInput(f"'model_type' must be a non-empty string, got {model_type!r}")
    if "text_config" in config and not isinstance(config["text_config"], (dict, type(None))):
        raise BadInput("'text_config' must be an object")
    view = text_view(config)
    for key in _POSITIVE_INTS + _OPTIONAL_POSITIVE_INTS:
        if key not in view:
            continue
        v = view[key]
        if v is None:  # HF writes null for "not set"; mlx-lm then uses its default
            continue
        if not _is_int(v):
            raise BadInput(f"'{key}' must be an integer, got {type(v).__name__} {v!r}")
        if v <= 0:
            raise BadInput(f"'{key}' must be positive, got {v}")
    _check_counts(config, "")
    for key in _POSITIVE_NUMBERS:
        v = view.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise BadInput(f"'{key}' must be a number, got {type(v).__name__} {v!r}")
        if v <= 0:
            raise BadInput(f"'{key}' must be positive, got {v}")
    heads, kv_heads = view.get("num_attention_heads"), view.get("num_key_value_heads")
    hidden = view.get("hidden_size")
    if heads and hidden and not view.get("head_dim") and hidden % heads:
        raise BadInput(
            f"'hidden_size' {hidden} is not divisible by 'num_attention_heads' {heads} "
            "(and there is no 'head_dim')"
        )
    if heads and kv_heads and heads % kv_heads:
        raise BadInput(
            f"'num_attention_heads' {heads} is not a multiple of 'num_key_value_heads' {kv_heads}"
        )
    for key in ("torch_dtype", "dtype"):
        if key in view and view[key] is not None and not isinstance(view[key], str):
            raise BadInput(f"'{key}' must be a string, got {view[key]!r}")
    quant = config.get("quantization")
    if quant is not None:
        if not isinstance(quant, dict):
            raise BadInput("'quantization' must be an object with 'bits' and 'group_size'")
        for key in ("bits", "group_size"):
            if not _is_int(quant.get(key)) or quant[key] <= 0:
                raise BadInput(f"'quantization.{key}' must be a positive integer")
    return model_type
