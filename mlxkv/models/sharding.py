"""Split a loaded model across the ranks of an ``mx.distributed`` group, the way mlx-lm does.

mlx-lm's ``sharded_load`` downloads and shards a hub repo; mlxkv loads local folders it has
converted itself (a single ``model.safetensors``, no index file), so it loads the model
lazily with its own loader and then calls the same two methods ``sharded_load`` calls:
``model.shard(group)`` (tensor parallel: every rank holds 1/N of each layer's heads and MLP)
or ``model.model.pipeline(group)`` (every rank holds a contiguous run of layers; rank 0 the
last ones). Nothing is evaluated before the split, so each rank materializes only its share.
"""

from __future__ import annotations

from mlxkv.errors import UserError

SHARD_MODES = ("auto", "tensor", "pipeline")


def supports(model) -> dict[str, bool]:
    return {
        "tensor": hasattr(model, "shard"),
        "pipeline": hasattr(model, "model") and hasattr(model.model, "pipeline"),
    }


def choose_mode(model, mode: str) -> str:
    """``auto`` -> tensor where ``shard()`` exists, else pipeline; refuse what cannot be done."""
    if mode not in SHARD_MODES:
        raise UserError(f"--shard must be one of {', '.join(SHARD_MODES)}, got '{mode}'")
    can = supports(model)
    name = getattr(model, "model_type", type(model).__module__.rsplit(".", 1)[-1])
    if mode == "auto":
        if can["tensor"]:
            return "tensor"
        if can["pipeline"]:
            return "pipeline"
        raise UserError(
            f"{name} cannot be split across ranks: mlx-lm gives it neither shard() nor "
            "pipeline(); run it on one machine"
        )
    if not can[mode]:
        other = "pipeline" if mode == "tensor" else "tensor"
        hint = f"; try --shard {other}" if can[other] else "; run it on one machine"
        what = "shard()" if mode == "tensor" else "model.pipeline()"
        raise UserError(f"{name} has no {what} in mlx-lm, so --shard {mode} is impossible{hint}")
    return mode


def shard_model(model, config: dict, group, mode: str) -> str:
    """Split ``model`` (lazy, unevaluated) over ``group``; returns the mode used."""
    from mlxkv.memory.hosts import check_split

    mode = choose_mode(model, mode)
    check_split(config, group.size(), mode)
    if mode == "tensor":
        model.shard(group)
    else:
        model.model.pipeline(group)
    return mode
