"""Element sizes and the dtype rule the engine follows (one place, importable without mlx).

Backends: ``metal`` (Apple Silicon), ``cuda`` (MLX's CUDA backend, ``mlx-cuda-12/13``, with
the GPU as MLX's default device) and ``cpu``. On a GPU (Metal or CUDA) the engine keeps
the checkpoint's dtype (float16/bfloat16) and its packed quantized weights, as mlx-lm does,
so the KV cache has that dtype too. On the CPU backend fp16/bf16 and quantized matmuls have
no fast path, so the engine loads weights as float32 (dequantized) and the KV cache follows
in float32. ``mlxkv.models.loader`` applies the rule; ``--dtype native`` names the GPU rule
on any backend (how the CPU tests run it).
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

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


BACKENDS = ("metal", "cuda", "cpu")
GPU_BACKENDS = ("metal", "cuda")
# The wheels that carry MLX's CUDA backend (the plain ``mlx`` wheel on Linux is CPU only).
CUDA_WHEELS = ("mlx-cuda-13", "mlx-cuda-12", "mlx-cuda")


def backend() -> str:
    """'metal' on Apple Silicon macOS; 'cuda' where MLX's default device is a CUDA GPU;
    else 'cpu'. ``MLXKV_DEVICE=cpu`` forces the CPU.

    MLX is imported only where a CUDA wheel is installed (to ask whether a GPU is there
    and is the default device); elsewhere this reads no more than the platform."""
    if os.environ.get("MLXKV_DEVICE", "").lower() == "cpu":
        return "cpu"
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return "metal"
    if sys.platform.startswith("linux") and _cuda_default():
        return "cuda"
    return "cpu"


def is_gpu(on: str) -> bool:
    """Whether backend ``on`` runs MLX on a GPU (keeps checkpoint dtypes, packed weights)."""
    return on in GPU_BACKENDS


def _cuda_wheel() -> bool:
    for name in CUDA_WHEELS:
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        return True
    return False


def _cuda_default() -> bool:
    """MLX was built with CUDA, sees a GPU, and the GPU is its default device."""
    if "mlx.core" not in sys.modules and not _cuda_wheel():
        return False
    try:
        import mlx.core as mx

        cuda = getattr(mx, "cuda", None)
        return bool(cuda and cuda.is_available()) and mx.default_device() == mx.gpu
    except (ImportError, OSError, RuntimeError, ValueError):  # no driver or CUDA libraries
        return False


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
    """dtype of the engine's floating weights: float32 on the CPU, the checkpoint's on a GPU
    (float16 where the config names none)."""
    if not is_gpu(on or backend()):
        return "float32"
    return gpu_weight_dtype(config)


def gpu_weight_dtype(config: dict) -> str:
    """The GPU rule's floating dtype: the checkpoint's, float16 where the config names none."""
    return config_dtype(config) or "float16"


def default_kv_dtype(config: dict, on: str | None = None) -> str:
    """dtype of the KV cache the engine builds: the activation dtype, i.e. the weights'."""
    return default_weight_dtype(config, on)
