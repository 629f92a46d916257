"""The thinking budget's processor on real MLX arrays: it counts the tokens inside a think
block (opened by the model or by the prompt), forces a multi-token end marker whole at the
budget, and lets every token through outside the block."""

from __future__ import annotations

import mlx.core as mx

from mlxkv.engine.thinking import ThinkBudget

VOCAB = 16
START, END = (5, 6), (7, 8)  # two-token markers, as Gemma's and others' are


def run(budget: int, prompt: list[int], wanted: list[int]) -> list[int]:
    """What greedy decoding writes when the model would write ``wanted`` in turn."""
    closer = ThinkBudget(budget, START, END)
    history, out = list(prompt), []
    for want in wanted:
        logits = mx.zeros((VOCAB,)) + mx.where(mx.arange(VOCAB) == want, 1.0, 0.0)
        token = int(mx.argmax(closer(mx.array(history), logits)).item())
        history.append(token)
        out.append(token)
    return out


def test_the_block_the_model_opens_is_closed_at_the_budget():
    # the model would think for five tokens (1 2 3 4 1), then answer (9 10)
    wanted = [5, 6, 1, 2, 3, 4, 1, 7, 8, 9, 10]
    assert run(9, [2, 3], wanted) == wanted  # within the budget: untouched
    assert run(2, [2, 3], wanted)[:6] == [5, 6, 1, 2, 7, 8]  # two tokens, then the end


def test_a_block_the_prompt_opened_counts_from_the_first_token():
    got = run(1, [2, 5, 6], [1, 2, 3, 7, 8, 9])
    assert got[:3] == [1, 7, 8]
    assert run(0, [2, 5, 6], [1, 2])[:2] == [7, 8]


def test_a_closed_block_in_the_prompt_leaves_the_answer_free():
    wanted = [1, 2, 3, 4]
    assert run(0, [5, 6, 1, 7, 8], wanted) == wanted
