"""The thinking budget's processor on real MLX arrays: it counts the tokens inside a think
block (opened by the model or by the prompt), forces a multi-token end marker whole at the
budget, and lets every token through outside the block."""

from __future__ import annotations

import mlx.core as mx

from mlxkv.engine.samplers import PROMPT_TAIL
from mlxkv.engine.thinking import ThinkBudget

VOCAB = 16
START, END = (5, 6), (7, 8)  # two-token markers, as Gemma's and others' are


def run(budget: int, prompt: list[int], wanted: list[int]) -> list[int]:
    """What greedy decoding writes when the model would write ``wanted`` in turn."""
    closer = ThinkBudget(budget, START, END, prompt)
    history, out = list(prompt[-PROMPT_TAIL:]), []  # as the engine shows it
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


def test_a_long_block_the_prompt_holds_is_still_open():
    """A continued turn whose reasoning the prompt already holds, longer than the tail of
    the prompt the processors are shown first: the budget still applies."""
    got = run(1, [2, 5, 6] + [1] * 40, [1, 2, 3, 7, 8, 9])
    assert got[:3] == [1, 7, 8]


def test_a_closed_block_in_the_prompt_leaves_the_answer_free():
    wanted = [1, 2, 3, 4]
    assert run(0, [5, 6, 1, 7, 8], wanted) == wanted


class Unread:
    """A history whose tokens may not be read: reading one waits for the device."""

    def __getitem__(self, _):
        raise AssertionError("a token was read")

    tolist = __getitem__


def test_no_token_is_read_once_the_block_closed_or_never_opened():
    logits = mx.zeros((VOCAB,))
    closed = ThinkBudget(9, START, END, [2, 5, 6])
    for history in ([2, 5, 6], [2, 5, 6, 1], [2, 5, 6, 1, 7], [2, 5, 6, 1, 7, 8]):
        closed(mx.array(history), logits)
    never = ThinkBudget(9, START, END, [2])
    for history in ([2], [2, 1], [2, 1, 2], [2, 1, 2, 3], [2, 1, 2, 3, 4], [2, 1, 2, 3, 4, 1]):
        never(mx.array(history), logits)
    for closer in (closed, never):
        assert closer(Unread(), logits) is logits


def _shown(closer: ThinkBudget, history: list[int], tokens: list[int]) -> list[int]:
    """Show ``closer`` each of ``tokens`` in turn, one call each as the engine's steps do;
    the token it lets a model that wants token 1 write after each."""
    out = []
    for t in tokens:
        history = [*history, t]
        logits = mx.where(mx.arange(VOCAB) == 1, 1.0, 0.0)
        out.append(int(mx.argmax(closer(mx.array(history), logits)).item()))
    return out


def test_tokens_rolled_back_are_forgotten():
    """A draft step shows the processor tokens the model may not keep: rolled back, it
    goes on as if it had never read them (its count inside the block, the end marker it
    was forcing)."""
    prompt, kept, then = [2, 3], [5, 6, 1], [1, 2, 7, 8]
    plain = ThinkBudget(3, START, END, prompt)
    _shown(plain, prompt[:-1], prompt[-1:])  # the first call: the prompt's, nothing read
    _shown(plain, prompt, kept)  # the block opened, one token of thinking
    reference = _shown(plain, prompt + kept, then)
    assert reference == [1, 7, 8, 1]  # at the budget the end marker is forced, then free

    drafted = ThinkBudget(3, START, END, prompt)
    _shown(drafted, prompt[:-1], prompt[-1:])
    _shown(drafted, prompt, kept)
    assert _shown(drafted, prompt + kept, [4, 4, 4]) == [1, 7, 8]  # the drafts' count
    drafted.rollback(3)
    assert _shown(drafted, prompt + kept, then) == reference
