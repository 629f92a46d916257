"""The per-layer cache layout: what the runtime builds for each layer, as plain data.

A layout is produced once from config.json (see ``probe``) and then used for arithmetic
only, so it is a frozen dataclass tree that round-trips through JSON (kept on disk so a
repeated ``mlxkv plan`` needs no MLX import).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mlxkv.memory.dtypes import dtype_bytes


@dataclass(frozen=True)
class CacheSpec:
    """One mlx-lm cache object (a layer may hold several, as a CacheList).

    ``dtype=None`` means "the activation dtype" (the KV dtype chosen for the run); a name
    means the runtime always stores that dtype.
    """

    cls: str  # mlx-lm class name, or "unused" for a cache the model never fills
    role: str  # attention | mla | sliding | chunked | ssm | linear | conv | recurrent | state
    kv_heads: int = 0
    k_head_dim: int = 0
    v_head_dim: int = 0
    dtype: str | None = None
    window: int | None = None  # RotatingKVCache max_size, ChunkedKVCache chunk_size
    keep: int = 0  # RotatingKVCache keep (never-evicted tokens)
    bits: int | None = None  # QuantizedKVCache built by the model itself
    group_size: int = 64
    # ArraysCache entries: (shape without the batch axis, dtype or None for activation)
    arrays: tuple[tuple[tuple[int, ...], str | None], ...] = ()
    in_list: bool = False  # part of a CacheList (mlxkv's make_caches leaves those alone)

    @property
    def grows(self) -> bool:
        """A plain top-level KVCache: keeps every token, so the user's policy applies."""
        return self.cls == "KVCache" and not self.in_list

    def elem_bytes(self, kv_dtype: str) -> int:
        return dtype_bytes(self.dtype or kv_dtype)

    def bytes_per_token(self, kv_dtype: str) -> int:
        """Bytes one token adds per batch row (0 for fixed-size states)."""
        if self.cls in ("KVCache", "RotatingKVCache", "ChunkedKVCache"):
            return self.kv_heads * (self.k_head_dim + self.v_head_dim) * self.elem_bytes(kv_dtype)
        if self.cls == "QuantizedKVCache":
            return self.kv_heads * (
                _quant_bytes(self.k_head_dim, self.bits, self.group_size, self.elem_bytes(kv_dtype))
                + _quant_bytes(
                    self.v_head_dim, self.bits, self.group_size, self.elem_bytes(kv_dtype)
                )
            )
        return 0

    def state_bytes(self, kv_dtype: str) -> int:
        """Fixed bytes per batch row (ArraysCache: SSM conv + state, linear-attention state)."""
        total = 0
        for shape, dt in self.arrays:
            n = 1
            for d in shape:
                n *= d
            total += n * dtype_bytes(dt or kv_dtype)
        return total

    def to_dict(self) -> dict:
        d = asdict(self)
        d["arrays"] = [[list(s), dt] for s, dt in self.arrays]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CacheSpec:
        d = dict(d)
        d["arrays"] = tuple((tuple(s), dt) for s, dt in d.get("arrays", ()))
        return cls(**d)


def _quant_bytes(dim: int, bits: int | None, group_size: int, scale_bytes: int) -> int:
    """Bytes of one quantized vector as QuantizedKVCache allocates it (packed + scales + biases)."""
    el_per_int = 32 // (bits or 8)
    return (dim // el_per_int) * 4 + 2 * (dim // group_size) * scale_bytes


@dataclass(frozen=True)
class LayerSpec:
    index: int
    parts: tuple[CacheSpec, ...]

    @property
    def kind(self) -> str:
        roles = [p.role for p in self.parts if p.cls != "unused"]
        return "+".join(dict.fromkeys(roles)) or "none"


@dataclass(frozen=True)
class ModelFacts:
    """Config facts the runtime estimates and the weights fallback need."""

    hidden_size: int = 0
    vocab_size: int = 0
    num_attention_heads: int = 0
    intermediate_size: int = 0
    max_position_embeddings: int | None = None
    declared_window: int | None = None  # the config's sliding_window, whatever the runtime does
    dense_params: int = 0  # parameters before quantization (what a dequantized load holds)
    float_params: int = 0  # floating parameters of the mlx-lm model (stored at weight dtype)
    fixed_param_bytes: int = 0  # packed quantized weights (uint32): dtype-independent
    quantized: bool = False
    mla: bool = False  # low-rank (MLA) attention somewhere (probe.is_mla)
    learned_sinks: bool = False  # attention sink logits somewhere (probe.has_learned_sinks)


@dataclass(frozen=True)
class Layout:
    model_type: str  # as the config says
    module: str  # the mlx-lm module that builds it
    layers: tuple[LayerSpec, ...]
    facts: ModelFacts = field(default_factory=ModelFacts)

    def specs(self):
        for layer in self.layers:
            yield from layer.parts

    def to_dict(self) -> dict:
        return {
            "model_type": self.model_type,
            "module": self.module,
            "layers": [
                {"index": li.index, "parts": [p.to_dict() for p in li.parts]} for li in self.layers
            ],
            "facts": asdict(self.facts),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Layout:
        layers = tuple(
            LayerSpec(li["index"], tuple(CacheSpec.from_dict(p) for p in li["parts"]))
            for li in d["layers"]
        )
        return cls(d["model_type"], d["module"], layers, ModelFacts(**d["facts"]))
