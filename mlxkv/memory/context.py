"""The model's trained context, and the one rule ``plan`` and ``generate`` share about it.

The trained context is ``max_position_embeddings`` (``max_seq_len`` in some configs), or
the length a rope-scaling block extends it to (``factor`` x
``original_max_position_embeddings`` for YaRN, dynamic NTK, LongRoPE, linear), whichever
is larger: Llama 3.1 declares 131,072 with a llama3 block (8 x 8,192 = 65,536, smaller);
Qwen2.5 declares 32,768 with YaRN x 4 over 32,768 = 131,072.

Past it a full cache holds positions the model never saw, so the engine refuses a prompt
that reaches it (and caps the reply so prompt + reply stay within it) unless the cache is
windowed (``--kv-window``), which keeps every position the model attends to in range.
"""

from __future__ import annotations

from mlxkv.memory.config import BadInput, text_view

_SCALED = ("yarn", "dynamic", "longrope", "linear", "su", "llama3")
MOST_CONTEXT = 2**40  # tokens: far past any model's, well within every integer used here


def _positive(v, tokens_of: str | None = None) -> int | None:
    """``v`` as a positive int (None if it is none); ``tokens_of``: the field, when ``v``
    counts tokens (and must be a context a model can have)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v <= 0:
        return None
    if tokens_of:
        _check_size(v, tokens_of)
    return int(v)


def _check_size(tokens: float, what: str) -> None:
    if tokens > MOST_CONTEXT:
        raise BadInput(f"{what} is {tokens:.3g} tokens, past any model's context; fix config.json")


def trained_context(config: dict) -> int | None:
    """Tokens the model was trained to attend over (None when the config does not say)."""
    view = text_view(config)
    limit = _positive(view.get("max_position_embeddings"), "max_position_embeddings") or _positive(
        view.get("max_seq_len"), "max_seq_len"
    )
    scaling = view.get("rope_scaling") or view.get("rope_parameters")
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type") or scaling.get("type")
        factor = _positive(scaling.get("factor"))
        original = _positive(
            scaling.get("original_max_position_embeddings"),
            "rope_scaling.original_max_position_embeddings",
        )
        if kind in _SCALED and factor and original:
            scale = float(scaling["factor"])  # factor above is truncated: 1.5 would be 1
            if scale > MOST_CONTEXT / original:
                raise BadInput(
                    f"rope_scaling.factor {scale:.3g} x original_max_position_embeddings "
                    f"{original} is past any model's context; fix config.json"
                )
            limit = max(limit or 0, int(scale * original))
    return limit


def past_trained_context(limit: int | None, window: int | None, tokens: int) -> bool:
    """True when ``tokens`` (prompt + reply) run past the trained context without a window:
    the engine refuses such a prompt, and ``plan`` says so."""
    return bool(limit) and window is None and tokens > limit
