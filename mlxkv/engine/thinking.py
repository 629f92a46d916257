"""A thinking budget: a thinking model (Qwen3, DeepSeek-R1 and the others mlx-lm finds think
markers for) may write at most so many tokens of reasoning; at the budget its think block
is closed for it (the end marker is forced) and it goes on to the answer.

The budget counts the tokens written inside the block, whether the model opened it or the
prompt did (DeepSeek-R1's template opens it for the model)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class ThinkBudget:
    """A logits processor (as mlx-lm's: called with the tokens seen and the logits) that
    closes the think block after ``budget`` tokens of reasoning; it reads each answer token
    from the history it is shown (the first call's is the prompt's tail: no answer yet)."""

    stateful = True  # it keeps what it has read: drafts it is shown are rolled back

    def __init__(
        self, budget: int, start: tuple[int, ...], end: tuple[int, ...], prompt: Sequence[int]
    ):
        self.budget = budget
        self.start, self.end = start, end
        # the whole prompt decides: a continued turn may hold a long block already
        self.inside = _last(prompt, start) > _last(prompt, end)
        self.spent = 0  # reasoning tokens since the block opened
        self.forcing: list[int] = []  # the end marker's tokens still to write
        self.first = True
        self.written = 0  # answer tokens read
        # once the block has closed, or the answer began without one, nothing is read:
        # reading a token waits for it, which stalls the next step's overlap
        self.done = False
        self._log: deque = deque(maxlen=256)  # its state before each of the last calls

    def __call__(self, history, logits):
        import mlx.core as mx

        self._log.append(
            (self.inside, self.spent, list(self.forcing), self.first, self.written, self.done)
        )
        if self.done:
            return logits
        if self.first:
            self.first = False
        else:
            self._read(history)
        if self.inside and self.spent >= self.budget and not self.forcing:
            self.forcing = list(self.end)
        if not self.forcing:
            return logits
        token = self.forcing.pop(0)
        keep = mx.arange(logits.shape[-1]) == token
        return mx.where(keep, logits, mx.array(-mx.inf, dtype=logits.dtype))

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` tokens read (drafts the model did not keep)."""
        for _ in range(n):
            state = self._log.pop()
        if n:
            self.inside, self.spent, self.forcing, self.first, self.written, self.done = state

    def _read(self, history) -> None:
        self.written += 1
        tail = [int(t) for t in history[-max(len(self.start), len(self.end)) :].tolist()]
        if _ends_with(tail, self.end):
            self.inside, self.forcing, self.done = False, [], True
        elif _ends_with(tail, self.start):
            self.inside, self.spent = True, 0
        elif self.inside:
            self.spent += 1
        elif self.written > len(self.start) + 2:
            self.done = True  # a model opens its block first (after a newline or two), or never


def _ends_with(tokens: list[int], marker: tuple[int, ...]) -> bool:
    return len(tokens) >= len(marker) and tuple(tokens[-len(marker) :]) == marker


def _last(tokens: Sequence[int], marker: tuple[int, ...]) -> int:
    """Where ``marker`` last ends in ``tokens`` (-1: nowhere)."""
    n, tail = len(marker), marker[-1]
    for i in range(len(tokens), n - 1, -1):
        if tokens[i - 1] == tail and tuple(tokens[i - n : i]) == marker:
            return i
    return -1


def think_budget(tokenizer, budget: int, prompt: Sequence[int]) -> ThinkBudget | None:
    """The processor for ``tokenizer``'s think markers and a request's ``prompt`` (None:
    the model has none)."""
    if not getattr(tokenizer, "has_thinking", False):
        return None
    encode = getattr(tokenizer, "_tokenizer", tokenizer).encode
    start = tuple(encode(tokenizer.think_start, add_special_tokens=False))
    end = tuple(encode(tokenizer.think_end, add_special_tokens=False))
    return ThinkBudget(budget, start, end, prompt) if start and end else None
