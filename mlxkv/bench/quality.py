"""Long-stream quality: perplexity per policy below and past the model's context length.

The losses come from the long streams (``policies.long_streams``): every position's
next-token loss with the cache as it was when that token was read, i.e. what a chat that
long would see. Full-cache perplexity below the context is the reference; a bounded cache
is judged on the tokens past the context, which the full cache cannot reach at all.
"""

from __future__ import annotations

import numpy as np

from mlxkv.bench.stream import StreamResult


def summary(streams: dict[str, StreamResult], context: int | None) -> dict[str, dict]:
    out = {}
    for key, r in streams.items():
        n = len(r.losses)
        split = context if context and context < n else None
        row = {"tokens": n, "ppl_all": r.ppl()}
        if split:
            row["ppl_below_context"] = r.ppl(0, split)
            row["ppl_past_context"] = r.ppl(split)
        else:
            row["ppl_below_context"] = r.ppl()
            row["ppl_past_context"] = None
        out[key] = row
    return out


def smoothed(losses: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean loss over consecutive blocks of ``width`` positions (x = block centre)."""
    n = len(losses) // width * width
    if n == 0:
        return np.array([len(losses) / 2]), np.array([losses.mean()])
    y = losses[:n].reshape(-1, width).mean(axis=1)
    x = np.arange(len(y)) * width + width / 2
    return x, y
