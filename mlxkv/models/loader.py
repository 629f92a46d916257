"""Load a resolved model folder with mlx-lm, in the dtype that is fast on this backend."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlxkv.errors import UserError, one_line

DTYPES = ("auto", "native", "float32", "float16", "bfloat16")
# The files mlx-lm and transformers read beside the weights, and the most each may hold
# (several times the largest seen: Gemma 3's tokenizer.json is 33 MB). A FIFO among them
# would block the load for ever, a huge one take gigabytes: both are refused first.
MODEL_FILES = {
    "tokenizer.json": 256 << 20,
    "tokenizer.model": 64 << 20,
    "vocab.json": 64 << 20,
    "vocab.txt": 64 << 20,
    "merges.txt": 64 << 20,
    "tokenizer_config.json": 64 << 20,
    "special_tokens_map.json": 16 << 20,
    "added_tokens.json": 16 << 20,
    "generation_config.json": 1 << 20,
    "chat_template.jinja": 4 << 20,
    "chat_template.json": 4 << 20,
}


@dataclass
class LoadedModel:
    model: object  # mlx.nn.Module
    tokenizer: object  # mlx_lm TokenizerWrapper
    config: dict
    path: Path
    dtype: str  # dtype of the unquantized weights (and so of the KV cache)
    name: str  # what the user asked for, for display
    weights_bytes: int = 0  # bytes of the loaded parameters
    layout: object = None  # mlxkv.memory.layout.Layout, built on first use
    shard: str | None = None  # "tensor" or "pipeline" when split over a distributed group
    rank: int = 0
    ranks: int = 1
    packed: bool = False  # quantized layers kept packed (the GPU rule), not dequantized

    @property
    def kv_layout(self):
        """The memory model's layout of this model's caches, built once."""
        if self.layout is None:
            from mlxkv.memory import layout_for

            self.layout = layout_for(self.config)
        return self.layout

    @property
    def context_length(self) -> int | None:
        """The trained context (the rule ``plan`` applies too)."""
        from mlxkv.memory.context import trained_context

        return trained_context(self.config)


def check_model_files(folder: Path) -> None:
    """Refuse (one line) a tokenizer or config file of ``folder`` that is not a regular file
    or is larger than MODEL_FILES allows, before any library reads it."""
    from mlxkv.files import check_file

    for name, limit in MODEL_FILES.items():
        if os.path.lexists(folder / name):
            check_file(folder / name, limit, "the model's file")


def load(
    path: Path,
    dtype: str = "auto",
    name: str | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    group=None,
    shard: str = "auto",
    packed: bool | None = None,
) -> LoadedModel:
    """Load weights and tokenizer, following the backend's dtype rule
    (:func:`weight_rule`): ``auto`` is float32 on the CPU (dequantized, see mlxkv.backend)
    and on a GPU (Metal, CUDA) the checkpoint's dtype with quantized layers kept packed;
    ``native`` is the GPU rule on any backend. ``packed`` overrides whether quantized layers
    stay packed (None: the rule's choice), so ``dtype="bfloat16", packed=True`` is a GPU
    load in bfloat16 wherever it runs.
    ``on_progress(bytes_done, bytes_total)`` follows the weights as they are read.

    With ``group`` (an ``mx.distributed`` group of more than one rank) the model is split
    over it before any weight is evaluated (``mlxkv.models.sharding``): each rank holds and
    reports only its share, and ``layout`` is the caches this rank builds."""
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten
    from mlx_lm.utils import dequantize_model

    from mlxkv.memory.working_set import wire_for_load

    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype} is not supported; use one of {', '.join(DTYPES)}")
    check_model_files(Path(path))
    try:
        model, tokenizer, config = mlx_lm.load(str(path), lazy=True, return_config=True)
    except Exception as e:  # the folder's files are the user's: any failure is theirs
        raise UserError(f"cannot load the model in {path}: {one_line(e)}") from None
    from mlxkv.models.chat_template import install

    install(tokenizer)  # the model's template is untrusted code: render it bounded
    target, keep = weight_rule(config, dtype)
    keep = keep if packed is None else packed
    quantized = any(n.endswith(".scales") for n, _ in tree_flatten(model.parameters()))
    if not keep:
        # in float32: the checkpoint's exact values, each rounded once to the target, and
        # MLX's CPU dequantize runs about twice as fast as on float16 scales
        model.set_dtype(mx.float32)
        dequantize_model(model)
    # Every floating parameter (norms, embeddings, quantization scales and biases) in the
    # target dtype, so activations stay in it; packed uint32 weights are left as they are.
    model.set_dtype(getattr(mx, target))
    mode, rank, ranks = None, 0, 1
    if group is not None and group.size() > 1:
        from mlxkv.models.sharding import shard_model

        mode, rank, ranks = shard_model(model, config, group, shard), group.rank(), group.size()
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))  # known while lazy
    wire_for_load(weights)  # on Metal: the weights stay resident, nothing more (see plan)
    _materialize(model, on_progress)
    loaded = LoadedModel(
        model, tokenizer, config, Path(path), target, name or Path(path).name, weights
    )
    loaded.packed = keep and quantized
    if mode is not None:
        from mlxkv.memory import layout_for
        from mlxkv.memory.hosts import host_layout

        loaded.layout = host_layout(layout_for(config), ranks, rank, mode)
        loaded.shard, loaded.rank, loaded.ranks = mode, rank, ranks
        # As mlx-lm's sharded_load: every rank is loaded before anyone computes.
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
    return loaded


def _materialize(model, on_progress, step: int = 64 << 20) -> None:
    """Read the (lazy) weights; with a progress callback, in groups of about ``step``
    bytes so a caller can show how far loading is."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    if on_progress is None:
        mx.eval(model.parameters())
        return
    arrays = [v for _, v in tree_flatten(model.parameters())]
    total, done, group, size = sum(v.nbytes for v in arrays), 0, [], 0
    on_progress(0, total)
    for v in arrays:
        group.append(v)
        size += v.nbytes
        if size >= step or v is arrays[-1]:
            mx.eval(group)
            done += size
            group, size = [], 0
            on_progress(done, total)


def weight_rule(config: dict, dtype: str = "auto", on: str | None = None) -> tuple[str, bool]:
    """(floating dtype, keep quantized layers packed) for ``--dtype dtype`` on backend ``on``
    (default: this machine's, :func:`mlxkv.memory.dtypes.backend`).

    * ``auto``: the backend's rule: on a GPU the checkpoint's dtype, packed; on the CPU
      float32, dequantized (fp16/bf16 and quantized matmuls have no CPU fast path).
    * ``native``: the GPU rule on any backend (the checkpoint's dtype, packed).
    * ``float32``/``float16``/``bfloat16``: that dtype; packed on a GPU, dequantized on the
      CPU."""
    from mlxkv.memory.dtypes import backend, gpu_weight_dtype, is_gpu

    gpu = is_gpu(on or backend())
    if dtype == "native" or (dtype == "auto" and gpu):
        return gpu_weight_dtype(config), True
    if dtype == "auto":
        return "float32", False
    return dtype, gpu
