"""Weights bytes as the engine will hold them, without loading a weight.

Sources, best first: local safetensors headers (exact tensor shapes and dtypes), the hub's
safetensors metadata (``huggingface_hub.get_safetensors_metadata``, headers only), else
the parameter count of mlx-lm's model built from the config (see ``probe``).

What the engine holds differs from the file (mlxkv.models.loader): on the CPU backend it
dequantizes and keeps every floating tensor in float32; on Metal quantized tensors stay
packed and floating ones keep the checkpoint dtype. fp8 checkpoints (DeepSeek-V3) are
dequantized by mlx-lm's sanitize, their block scales dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlxkv.memory.dtypes import dtype_bytes
from mlxkv.safetensors_table import DTYPES, Tensor, read_table


@dataclass(frozen=True)
class Weights:
    bytes: int  # as the engine holds them
    file_bytes: int | None  # as stored (None when counted from the config)
    params: int  # parameters, quantized ones counted unpacked
    source: str  # where the numbers come from, for the user


def read_header(path: Path) -> list[Tensor]:
    """Tensors of one safetensors file from its JSON header (reads a few KB, not the data)."""
    return read_table(path)[0]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _group_for(name: str, quant: dict) -> int:
    """Group size of one packed tensor (mlx-lm allows per-layer overrides)."""
    override = quant.get(name.rsplit(".", 1)[0])
    if isinstance(override, dict) and "group_size" in override:
        return override["group_size"]
    return quant.get("group_size", 64)


def from_tensors(
    tensors: list[Tensor], config: dict, weight_dtype: str, dequantize: bool, source: str
) -> Weights:
    """Resident bytes of the tensors: packed weights unpacked when ``dequantize``."""
    quant = config.get("quantization") or config.get("quantization_config") or {}
    numel = {t.name: t.numel for t in tensors}
    wb = dtype_bytes(weight_dtype)
    total = file_total = params = 0
    for t in tensors:
        size, floating = DTYPES.get(t.dtype, (4, False))
        file_total += t.numel * size
        base = t.name.rsplit(".", 1)[0]
        if t.name.endswith("weight_scale_inv"):  # fp8 block scales: folded in at load
            continue
        packed = t.dtype == "U32" and f"{base}.scales" in numel
        is_qparam = t.name.endswith((".scales", ".biases")) and f"{base}.weight" in numel
        if packed:
            # One scale per group, whatever the bits (GGUF imports mix 4 and 8 bits).
            n = numel[f"{base}.scales"] * _group_for(t.name, quant)
            params += n
            total += n * wb if dequantize else t.numel * size
        elif is_qparam:
            if not dequantize:
                total += t.numel * wb
        else:
            params += t.numel
            total += t.numel * (wb if floating else size)
    return Weights(total, file_total, params, source)


def from_local(folder: Path, config: dict, weight_dtype: str, dequantize: bool) -> Weights | None:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    tensors = [t for f in files for t in read_header(f)]
    return from_tensors(
        tensors, config, weight_dtype, dequantize, f"safetensors headers ({len(files)} local files)"
    )


def from_hub(repo: str, config: dict, weight_dtype: str, dequantize: bool) -> Weights:
    """Raises whatever huggingface_hub raises when the hub is unreachable."""
    from huggingface_hub import get_safetensors_metadata

    meta = get_safetensors_metadata(repo)
    tensors = [
        Tensor(name, info.dtype, _numel(info.shape), 0)
        for fm in meta.files_metadata.values()
        for name, info in fm.tensors.items()
    ]
    source = f"hub safetensors metadata ({repo})"
    return from_tensors(tensors, config, weight_dtype, dequantize, source)


def from_layout(facts, weight_dtype: str, dequantize: bool) -> Weights:
    """From the parameters of mlx-lm's model built from the config (all experts resident,
    tied embeddings stored once, quantized layers packed as the config says)."""
    wb = dtype_bytes(weight_dtype)
    if dequantize and facts.quantized:
        # Unpacked: parameters = the model's unquantized count, recorded by the probe.
        n = facts.dense_params
        return Weights(n * wb, None, n, "parameter count from config.json (mlx-lm model)")
    n = facts.float_params
    return Weights(
        n * wb + facts.fixed_param_bytes,
        None,
        facts.dense_params or n,
        "parameter count from config.json (mlx-lm model)",
    )
