"""Logits of the last position of a model call (what the first token of an answer needs),
and the final hidden states alone (what an embedding pools).

An mlx-lm model call applies the output head (vocabulary x hidden) at every position it is
given, while a prompt only needs the logits of its last one. On the default model the head
is about a quarter of a token's matmul work, so a prompt chunk that must produce logits
pays it for every token. For models whose call is exactly "body, then norm'd hidden states
through the head" (the modules below share llama's ``Model.__call__`` line for line in
mlx-lm 0.32) we run the body and apply the head to the last position alone; any other
model is called whole and sliced.
"""

from __future__ import annotations

import sys

# mlx-lm modules whose Model.__call__ is: out = self.model(inputs, cache, input_embeddings);
# then embed_tokens.as_linear(out) if args.tie_word_embeddings else lm_head(out).
BODY_THEN_HEAD = frozenset(
    {"mlx_lm.models." + m for m in ("llama", "qwen2", "qwen3", "smollm3", "ministral3")}
)


def head_split(model) -> bool:
    """Whether :func:`last_logits` can run ``model``'s body and head apart."""
    cls = type(model)
    mod = sys.modules.get(cls.__module__)
    return (
        cls.__module__ in BODY_THEN_HEAD
        and getattr(mod, "Model", None) is cls
        and hasattr(model, "model")
        and hasattr(getattr(model, "args", None), "tie_word_embeddings")
    )


def last_logits(model, inputs, cache):
    """Logits (B, 1, vocab) of the last position of ``model(inputs, cache=cache)``."""
    if not head_split(model):
        return model(inputs, cache=cache)[:, -1:, :]
    h = model.model(inputs, cache)[:, -1:, :]
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(h)
    return model.lm_head(h)


def no_hidden_states(model) -> str:
    """Why a model without them cannot give embeddings, and which can."""
    families = ", ".join(sorted(m.rsplit(".", 1)[1] for m in BODY_THEN_HEAD))
    return (
        f"this model ({type(model).__module__}) gives no final hidden states mlxkv can read, "
        f"so it cannot make embeddings; serve a model of the {families} families "
        "(an embedding model such as Qwen3-Embedding is one)"
    )


def hidden_states(model, inputs, cache):
    """The final hidden states (B, L, hidden) of ``model``'s body over ``inputs``, normed,
    before the output head (a model :func:`head_split` takes)."""
    return model.model(inputs, cache)
