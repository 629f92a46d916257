"""Element sizes and the dtype rule the engine follows (one place, importable without mlx).

On Apple Silicon (Metal) the engine keeps the checkpoint's dtype (float16/bfloat16), so the
KV cache has that dtype too. On the CPU backend fp16/bf16 matmuls have no fast path, so the
engine loads weights as float32 and the KV cache follows in float32.
"""

from __future__ import annotations

import os
import platform
import sys

from mlxkv.memory.config import BadInput, text_view

DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "uint32": 4,
    "int32": 4,
    "uint8": 1,
    "int8": 1,
    "uint16": 2,
    "int16": 2,
    "uint64": 8,
    "int64": 8,
    "bool": 1,
    "complex64": 8,
}
KV_DTYPES = ("float16", "bfloat16", "float32")
# HF spells dtypes in several ways.
_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32"}


def dtype_bytes(name: str) -> int:
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise BadInput(f"unknown dtype '{name}'") from None


def backend() -> str:
    """'metal' on Apple Silicon macOS, else 'cpu'. ``MLXKV_DEVICE=cpu`` forces the CPU."""
    if os.environ.get("MLXKV_DEVICE", "").lower() == "cpu":
        return "cpu"
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return "metal"
    return "cpu"


def config_dtype(config: dict) -> str | None:
    """The checkpoint's floating dtype as the config states it (None if it does not)."""
    view = text_view(config)
    name = view.get("torch_dtype") or view.get("dtype")
    if not isinstance(name, str):
        return None
    name = name.removeprefix("torch.")
    name = _ALIASES.get(name, name)
    return name if name in KV_DTYPES else None


def default_weight_dtype(config: dict, on: str | None = None) -> str:
    """dtype of the engine's floating weights: float32 on the CPU, the checkpoint's on Metal."""
    if (on or backend()) == "cpu":
        return "float32"
    return config_dtype(config) or "float16"


def default_kv_dtype(config: dict, on: str | None = None) -> str:
    """dtype of the KV cache the engine builds: the activation dtype, i.e. the weights'."""
    return default_weight_dtype(config, on)
