"""mlxkv: local chat models on MLX, built around the KV cache."""

from mlxkv.backend import preload_fast_blas

__version__ = "0.1.0"

# Before anything imports MLX: on Linux, route its BLAS to OpenBLAS when installed.
preload_fast_blas()
