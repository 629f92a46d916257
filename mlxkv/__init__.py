"""mlxkv: local chat models on MLX, built around the KV cache."""

__version__ = "0.1.0"
