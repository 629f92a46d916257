"""Reusing caches that hold a token prefix: the one home of that rule and of its files.

Caches that have seen ``tokens`` can serve a new prompt ``ids`` up to their longest common
prefix with ``ids[:-1]`` (the prompt's last token is always fed: its logits start the
answer). Removing the rest must leave the caches as an uncached run over the kept prefix
would have left them. A full cache trims exactly. A window or sink cache that has evicted
cannot bring back what it dropped, and recurrent states cannot be rewound; for those a copy
of the caches taken at a turn boundary (the prompt prefilled, before its last token) is
restored instead. Only what neither reaches is rebuilt.

A :class:`~mlxkv.engine.session.Session` keeps its conversation's caches this way, and the
server's prefix cache (:mod:`mlxkv.engine.prefix_cache`) keeps finished requests' caches
this way; both save them to files with :func:`save_held` and read them with
:func:`load_held`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from mlxkv.engine.request import common_prefix


def state_bytes(states) -> int:
    from mlx.utils import tree_flatten

    return sum(x.nbytes for _, x in tree_flatten(states) if hasattr(x, "nbytes"))


@dataclass(eq=False)  # compared by identity: states hold MLX arrays
class Checkpoint:
    tokens: list[int]  # what the caches held when the copy was taken
    states: list  # each layer's state (``mlxkv.caches.snapshot``)
    # The bytes admission counts for it. Across the ranks of a split model every rank
    # counts the largest rank's, so that they all decide alike; None: its own.
    counted: int | None = None

    @property
    def nbytes(self) -> int:
        return state_bytes(self.states) if self.counted is None else self.counted


def keep_prefix(caches: list, tokens: list[int], checkpoint: Checkpoint | None, ids) -> int | None:
    """Make ``caches`` (which hold ``tokens``; both changed in place) hold the longest usable
    prefix of ``ids[:-1]``; returns its length, or None when neither a trim nor the
    checkpoint reaches a common prefix (the caller rebuilds)."""
    from mlxkv.caches import restore, trim_caches, trimmable

    want = common_prefix(tokens, ids[:-1])
    drop = len(tokens) - want
    if drop == 0:
        return want
    if all(trimmable(c) >= drop for c in caches):
        trim_caches(caches, drop)
        del tokens[want:]
        return want
    cp = checkpoint
    if cp is not None and common_prefix(cp.tokens, ids[:-1]) > 0:
        restore(caches, cp.states)
        tokens[:] = cp.tokens
        # then trimmed to what it shares with ids, where it can be (a copy taken before
        # the window evicted trims back to an edit made before it)
        return keep_prefix(caches, tokens, None, ids)
    return None


def cache_identity(loaded) -> dict:
    """What saved caches must match besides their policy: the model by its content (config,
    weights, tokenizer; never its name), the dtype, and whether weights are packed."""
    from mlxkv.models.identity import model_identity

    return {
        "model_id": model_identity(loaded.path),
        "dtype": loaded.dtype,
        # the GPU rule keeps quantized layers packed: other weights, other KV. None (what
        # a file from before this key reads as) for dequantized weights.
        "weights": "packed" if getattr(loaded, "packed", False) else None,
    }


def save_held(path, caches: list, tokens: list[int], checkpoint: Checkpoint | None, meta: dict):
    """Write caches holding ``tokens`` and their turn-boundary copy to ``path`` (atomically),
    with ``meta`` (the model's identity, policy, dtype) beside them."""
    from mlxkv.caches import save_caches

    caches = list(caches)
    meta = dict(meta, tokens=list(tokens), layers=len(caches))
    if checkpoint is not None:
        for c, state in zip(list(caches), checkpoint.states, strict=True):
            c = copy.copy(c)
            c.state = state
            caches.append(c)
        meta["checkpoint_tokens"] = list(checkpoint.tokens)
    save_caches(path, caches, meta)


def load_held(path, identity: dict, model, policy) -> tuple[list, list[int], Checkpoint | None]:
    """Caches, token ids and turn-boundary copy saved at ``path``, every part checked
    against ``identity`` (model, policy, dtype) and this model first (``CacheError``)."""
    from mlxkv.caches.persist import load_session

    caches, tokens, cp = load_session(path, identity, model, policy)
    checkpoint = None
    if cp is not None:
        checkpoint = Checkpoint(list(cp[1]), [c.state for c in cp[0]])
    return caches, list(tokens), checkpoint
