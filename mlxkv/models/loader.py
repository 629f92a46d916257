"""Load a resolved model folder with mlx-lm, in the dtype that is fast on this backend."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlxkv.errors import UserError, one_line

DTYPES = ("auto", "native", "float32", "float16", "bfloat16")


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

    @property
    def context_length(self) -> int | None:
        """The trained context (the rule ``plan`` applies too)."""
        from mlxkv.memory.context import trained_context

        return trained_context(self.config)


def load(
    path: Path,
    dtype: str = "auto",
    name: str | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    group=None,
    shard: str = "auto",
) -> LoadedModel:
    """Load weights and tokenizer. ``auto``: float32 on the CPU (dequantized, see
    mlxkv.backend), the checkpoint's dtype on Metal with quantized layers kept.
    ``on_progress(bytes_done, bytes_total)`` follows the weights as they are read.

    With ``group`` (an ``mx.distributed`` group of more than one rank) the model is split
    over it before any weight is evaluated (``mlxkv.models.sharding``): each rank holds and
    reports only its share, and ``layout`` is the caches this rank builds."""
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten
    from mlx_lm.utils import dequantize_model

    from mlxkv.memory.dtypes import default_weight_dtype
    from mlxkv.memory.working_set import wire_for_load

    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype} is not supported; use one of {', '.join(DTYPES)}")
    try:
        model, tokenizer, config = mlx_lm.load(str(path), lazy=True, return_config=True)
    except Exception as e:  # the folder's files are the user's: any failure is theirs
        raise UserError(f"cannot load the model in {path}: {one_line(e)}") from None
    from mlxkv.models.chat_template import install

    install(tokenizer)  # the model's template is untrusted code: render it bounded
    if dtype == "native":  # as stored: quantized layers stay quantized (mlx-lm's default)
        target = _float_dtype(model)
    else:
        target = default_weight_dtype(config) if dtype == "auto" else dtype
        if target == "float32" or dtype != "auto":
            # An explicit dtype means plain weights in that dtype: dequantize first.
            dequantize_model(model)
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


def _float_dtype(model) -> str:
    """The dtype of the model's unquantized floating parameters (its activation dtype)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    for name, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating) and not name.endswith(("scales", "biases")):
            return str(v.dtype).removeprefix("mlx.core.")
    return "float32"
