"""Open a model for generation: resolve it, check it fits, load it."""

from __future__ import annotations

from collections.abc import Callable

from mlxkv.models.loader import LoadedModel, load
from mlxkv.models.resolve import resolve
from mlxkv.policy import KVPolicy


def open_model(
    model: str | None,
    dtype: str = "auto",
    policy: KVPolicy | None = None,
    force: bool = False,
    context: int | None = None,
    batch: int = 1,
    on_status: Callable[[str], None] = lambda _m: None,
    on_progress: Callable[[int, int], None] | None = None,
    cluster=None,
    shard: str = "auto",
    chat_template=None,
) -> LoadedModel:
    """Resolve ``model``, refuse it (UserError) if the memory model says it won't fit at
    ``context`` tokens under ``policy`` (``batch`` sequences at once) unless ``force``,
    then load it (``on_progress(bytes_done, bytes_total)`` follows the weights). With
    ``cluster`` (``mlxkv.engine.distributed.Cluster``) the model is split over its ranks
    (``shard``: auto, tensor or pipeline) and the check is this rank's share.
    ``chat_template`` (``mlxkv.models.chat_template.ChatTemplate``: ``--chat-template``,
    ``--chat-template-args``) renders conversations in place of the model's template."""
    resolved = resolve(model, on_status=on_status)
    on_status(f"model {resolved.path} ({resolved.source})")
    group = cluster.group if cluster is not None else None
    if not force and group is None:
        from mlxkv.memory import check_fits

        check_fits(resolved.path, policy or KVPolicy(), context, batch)
    elif not force:
        from mlxkv.memory.hosts import check_host_fits

        check_host_fits(
            resolved.path, policy or KVPolicy(), context, batch, group.size(), group.rank(), shard
        )
    on_status("loading weights ..." if group is None else f"loading this rank's share ({shard})")
    name = resolved.alias or model or resolved.path.name
    loaded = load(
        resolved.path, dtype=dtype, name=name, on_progress=on_progress, group=group, shard=shard
    )
    if chat_template is not None:
        from mlxkv.models.chat_template import use_template

        use_template(loaded.tokenizer, chat_template)
        if chat_template.path is not None:
            on_status(f"chat template from {chat_template.path}")
    return loaded
