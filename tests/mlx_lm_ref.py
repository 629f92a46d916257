"""References computed by mlx-lm itself, for token identity: its generate_step and the
sampling rules written out in numpy."""

from __future__ import annotations


def greedy_tokens(loaded, ids, n, processors, until=()) -> list[int]:
    """Greedy tokens of mlx-lm's own generate_step with ``processors`` (the reference), up to
    ``n`` or the first token in ``until`` (kept: mlx-lm itself goes on)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    steps = generate_step(
        mx.array(ids),
        loaded.model,
        max_tokens=n,
        sampler=lambda lp: mx.argmax(lp, axis=-1),
        logits_processors=processors,
        prompt_cache=make_prompt_cache(loaded.model),
    )
    out = []
    for t, _ in steps:
        out.append(int(t))
        if out[-1] in until:
            break
    return out


def answer_penalties(prompt_len: int, presence: float, frequency: float, bias: dict):
    """OpenAI's penalties written out: each token's count in the answer so far (not the
    prompt) costs ``presence`` once and ``frequency`` per occurrence; ``bias`` adds."""
    import mlx.core as mx
    import numpy as np

    def process(tokens, logits):
        answer = np.array(tokens.tolist()[prompt_len:], dtype=np.int64)
        counts = np.bincount(answer, minlength=logits.shape[-1])
        out = np.array(logits.astype(mx.float32)) - presence * (counts > 0) - frequency * counts
        for token, b in bias.items():
            out[:, token] += b
        return mx.array(out)

    return process


def eos_held(prompt_len: int, eos, until: int | None):
    """EOS kept from being drawn while the answer has fewer than ``until`` tokens (None:
    always): vLLM's min_tokens and llama.cpp's ignore_eos, written out."""
    import mlx.core as mx
    import numpy as np

    def process(tokens, logits):
        if until is not None and len(tokens.tolist()) - prompt_len >= until:
            return logits
        out = np.array(logits.astype(mx.float32))
        out[:, list(eos)] = -np.inf
        return mx.array(out)

    return process
