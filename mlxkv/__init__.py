"""mlxkv: local chat models on MLX, built around the KV cache.

Importing mlxkv changes nothing in the process: entry points call
``mlxkv.backend.setup_blas()`` themselves, before MLX is imported.
"""

__version__ = "0.1.0"
