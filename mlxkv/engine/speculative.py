"""Which drafts a step keeps, and the token after them.

A step feeds the token sampled last and ``n`` drafts after it, and gets the model's logits
at each of the ``n + 1`` positions. A greedy answer keeps the drafts that equal the argmax
there: its text is the one plain steps give. A sampled answer keeps each draft ``d`` with
the probability ``p(d)`` its sampler gives ``d`` at that position, and at the first draft
it does not keep draws the next token from ``p`` with ``d`` taken out (speculative sampling,
Leviathan et al. 2023 / Chen et al. 2023, for a draft that puts all its weight on one
token): every token is drawn from the sampler's own distribution, whatever the drafts.
Both read back as one small array: the step waits for the device once.
"""

from __future__ import annotations


def check_greedy(logits, drafts: list[int]) -> tuple[int, int]:
    """(drafts kept, the next token) from ``logits`` (n + 1, vocab)."""
    import mlx.core as mx

    best = mx.argmax(logits, axis=-1)
    return _first_miss(best[:-1] != mx.array(drafts), best)


def check_sampled(weights, drafts: list[int], key=None) -> tuple[int, int]:
    """(drafts kept, the next token) for a sampled answer. ``weights`` (n + 1, vocab): the
    log-weights its sampler draws from at each position (filtered and tempered; they need
    not sum to one). ``key``: an MLX random key (None: MLX's global one)."""
    import mlx.core as mx

    n = len(drafts)
    weights = weights.astype(mx.float32)
    logp = weights - mx.logsumexp(weights, axis=-1, keepdims=True)
    d = mx.array(drafts)[:, None]
    kept_p = mx.exp(mx.take_along_axis(logp[:n], d, axis=-1)[:, 0])
    keys = mx.random.split(key, 2) if key is not None else (None, None)
    coin = mx.random.uniform(shape=(n,), key=keys[0])
    # each position's draw if its draft is not kept: its distribution less the draft (the
    # last position, after every draft, draws from its whole distribution)
    residual = mx.put_along_axis(weights[:n], d, mx.array(-mx.inf, mx.float32), axis=-1)
    draws = mx.random.categorical(mx.concatenate([residual, weights[n:]]), key=keys[1])
    return _first_miss(coin >= kept_p, draws)


def _first_miss(missed, tokens) -> tuple[int, int]:
    """The first position whose draft is not kept (n when all are) and its token."""
    import mlx.core as mx

    missed = mx.concatenate([missed, mx.array([True])]).astype(mx.int32)
    taken = mx.argmax(missed)
    out = mx.stack([taken, tokens[taken].astype(taken.dtype)]).tolist()
    return int(out[0]), int(out[1])
