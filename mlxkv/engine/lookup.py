"""Draft tokens from the conversation itself (prompt lookup decoding).

An answer often repeats what its conversation already holds: code being edited, a quoted
passage, a name, a tool's output. Where the last tokens fed also occur earlier, the tokens
that followed them there are a guess at what comes next; the model checks the whole guess
in one step (:mod:`mlxkv.engine.scheduler`) and keeps the part it would have produced
itself (:mod:`mlxkv.engine.speculative`), so a greedy answer is unchanged, a sampled one
is drawn from the same distribution, and several tokens cost about one step.

The index maps every n-gram (``NGRAM_MIN``..``NGRAM_MAX`` tokens) to the position after its
latest occurrence, updated as tokens are added: a lookup is a few dictionary reads, and a
prompt of ``n`` tokens costs about ``n x 2`` entries. A client's predicted output (the text
it expects back, such as the edited file) is indexed too, ahead of the prompt. The longest
n-gram that matches wins; the draft length adapts to how many of a row's drafts were taken
(docs/serve.md#drafts-from-the-conversation has the measured alternatives).
"""

from __future__ import annotations

DRAFT_TOKENS = 8  # the commands' default most drafts a step (measured in the docs)
MAX_DRAFT_TOKENS = 64
NGRAM_MIN = 2  # a single shared token is too weak a sign: mostly rejected drafts
NGRAM_MAX = 3


class PromptLookup:
    """The tokens of one request (its prompt, then its answer as it is fed), indexed."""

    def __init__(
        self,
        prompt: list[int],
        hint: list[int] | tuple[int, ...] = (),
        ngram_min: int = NGRAM_MIN,
        ngram_max: int = NGRAM_MAX,
    ):
        """``hint``: the answer's expected tokens (a predicted output), indexed after the
        prompt so that its continuations win over the prompt's, but never part of what
        the last tokens are."""
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.tokens: list[int] = []
        self.hint = list(hint)
        # n-gram -> position after its latest occurrence: in ``tokens`` (>= 0) or, as
        # -1 - i, at ``hint[i]``
        self._after: dict[tuple[int, ...], int] = {}
        self._answer = 0  # answer tokens already added
        self.extend(prompt)
        for end in range(1, len(self.hint)):
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                self._after[tuple(self.hint[end - n : end])] = -1 - end

    def extend(self, tokens: list[int]) -> None:
        seq, after = self.tokens, self._after
        for t in tokens:
            end = len(seq)  # the n-grams ending just before ``t`` are followed by it
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                after[tuple(seq[end - n : end])] = end
            seq.append(t)

    def follow(self, answer: list[int]) -> None:
        """Add the answer tokens not added yet (``answer`` is all of them so far)."""
        if len(answer) > self._answer:
            self.extend(answer[self._answer :])
            self._answer = len(answer)

    def draft(self, most: int, pending: tuple[int, ...] = ()) -> list[int]:
        """Up to ``most`` tokens that followed the latest earlier occurrence of the longest
        n-gram ending the tokens (then ``pending``, tokens about to be added); [] if none."""
        if most <= 0:
            return []
        seq, held = self.tokens, len(self.tokens)
        tail = seq[max(0, held - self.ngram_max) :] + list(pending)
        for n in range(min(self.ngram_max, len(tail)), self.ngram_min - 1, -1):
            start = self._after.get(tuple(tail[-n:]))
            if start is None:
                continue
            if start < 0:  # in the hint
                return self.hint[-1 - start : -1 - start + most]
            out = seq[start : start + most]  # an entry is a held position: start < held
            if len(out) < most:  # the guess runs on into the pending tokens
                out += list(pending[: most - len(out)])
            return out
        return []


def adapt_draft_length(length: int, taken: int, drafted: int, most: int) -> int:
    """The next step's draft length: longer (by 2, up to ``most``) after every draft was
    taken, shorter (by 1, down to 1) after one was not, so a row whose guesses fail spends
    little on them (the schedule of Hugging Face's assisted generation)."""
    if taken == drafted:
        return min(most, length + 2)
    return max(1, length - 1)
