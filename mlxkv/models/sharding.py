"""Split a loaded model across the ranks of an ``mx.distributed`` group, the way mlx-lm does.

mlx-lm's ``sharded_load`` downloads and shards a hub repo; mlxkv loads local folders it has
converted itself (a single ``model.safetensors``, no index file), so it loads the model
lazily with its own loader and then calls the same two methods ``sharded_load`` calls:
``model.shard(group)`` (tensor parallel: every rank holds 1/N of each layer's heads and MLP)
or ``model.model.pipeline(group)`` (every rank holds a contiguous run of layers; rank 0 the
last ones). Nothing is evaluated before the split, so each rank materializes only its share.
"""

from __future__ import annotations


def shard_model(model, config: dict, group, mode: str) -> str:
    """Split ``model`` (lazy, unevaluated) over ``group``; returns the mode used."""
    from mlxkv.memory.hosts import choose_split, shard, splits_of

    mode = choose_split(config, mode, group.size(), can=splits_of(model))
    if mode == "tensor":
        shard(model, group, config.get("model_type", "the model"))
    else:
        model.model.pipeline(group)
    return mode
