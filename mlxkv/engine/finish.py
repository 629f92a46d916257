"""The one finish rule: EOS, stop strings, the token limit and the context cap, a code
completion's block and time limits, and the answer's text as it streams (held back while a
stop string may be starting)."""

from __future__ import annotations

import time

from mlxkv.engine.stopping import StopMatcher

# the reasons an answer ends that may cut it inside a character's bytes (a limit, a cancel)
CUT = ("length", "context", "time", "cancelled")


class FinishRule:
    """Follows one answer token by token.

    ``add(token)`` returns ``(delta, reason)``: the text that may be shown now, and why the
    answer ends with this token (None: it goes on). An EOS token or a stop string ends it
    without a delta (a stop string not before the answer's ``min_tokens``-th token), as
    does a line indented less than ``min_indent`` (cut where its text starts: a code
    completion's block is done); past ``time_limit`` seconds an answer that holds a line
    break ends (llama.cpp's ``n_indent`` and ``t_max_predict_ms``). ``end()`` then gives
    the rest of the text and the whole answer.
    """

    def __init__(
        self,
        tokenizer,
        stop,
        max_tokens: int,
        capped: bool = False,
        after: tuple[int, ...] = (),
        min_tokens: int = 0,
        min_indent: int = 0,
        time_limit: float | None = None,
    ):
        self.eos = set(tokenizer.eos_token_ids)
        # The answer's text is what its tokens add to the text of ``after`` (the prompt's
        # last token, for a continuation): mlx-lm's detokenizers drop the space a text's
        # first token starts with, right for a chat message, but a continuation's own
        # (" Paris" after "The capital of France is").
        self.before = ""
        self.detok = tokenizer.detokenizer
        if after:
            seed = tokenizer.detokenizer
            for t in after:
                seed.add_token(t)
                self.detok.add_token(t)
            seed.finalize()
            self.before = seed.text
        self.stop = StopMatcher(stop)
        # a stop string counts once it ends after the text of the first min_tokens - 1
        # tokens (vLLM's rule; the sampler holds EOS back as long)
        self.min_tokens = min_tokens
        self.stops_from = 0
        self.min_indent = min_indent
        self.lines_from = 0  # where the search for the next line start goes on from
        self.deadline = None if time_limit is None else time.monotonic() + time_limit
        self.max_tokens = max_tokens
        self.capped = capped  # max_tokens was cut to what the context has room for
        self.tokens: list[int] = []
        self.text = ""
        self.shown = 0
        self.reason: str | None = None
        self.matched: str | None = None  # the stop string that ended the answer

    def add(self, token: int) -> tuple[str, str | None]:
        self.tokens.append(token)
        if token in self.eos:
            self.reason = "stop"
            return "", self.reason
        self.detok.add_token(token)
        text = self._answer(self.detok.text)
        hit = None
        if len(self.tokens) < self.min_tokens:
            self.stops_from = len(text)
        else:
            hit = self.stop.find(text, self.stops_from)
        if hit is not None:
            cut, self.matched = hit
            self.text, self.reason = text[:cut], "stop_string"
            return "", self.reason
        if self.min_indent and (cut := self._outdented(text)) is not None:
            self.text, self.reason = text[:cut], "indent"
            return "", self.reason
        safe = self.stop.safe_length(text)
        delta, self.shown = text[self.shown : safe], max(self.shown, safe)
        self.text = text
        if len(self.tokens) >= self.max_tokens:
            self.reason = "context" if self.capped else "length"
        elif self.deadline is not None and time.monotonic() > self.deadline and "\n" in text:
            self.reason = "time"
        return delta, self.reason

    def _outdented(self, text: str) -> int | None:
        """Where the first line after a line break that is indented (spaces, tabs) less
        than ``min_indent`` starts its text, a blank line's break included; None while
        none is (a line of blanks alone is not decided yet)."""
        while (brk := text.find("\n", self.lines_from)) >= 0:
            start = pos = brk + 1
            while pos < len(text) and text[pos] in " \t":
                pos += 1
            if pos == len(text):
                return None
            if pos - start < self.min_indent:
                return pos
            self.lines_from = start
        return None

    def end(self, reason: str | None = None) -> tuple[str, str]:
        """Close the answer (``reason`` when it ends from outside, e.g. a cancel); returns
        (text not yet shown, the whole answer's text)."""
        self.reason = self.reason or reason or "length"
        if self.reason not in ("stop_string", "indent"):  # (those cut the text)
            self.detok.finalize()
            text = self._answer(self.detok.text)
            if self.reason in CUT:  # a character cut short is left out, not shown as U+FFFD
                text = text[: max(self.shown, len(text.rstrip("\ufffd")))]
            self.text = text
        rest = self.text[self.shown :]
        self.shown = len(self.text)
        return rest, self.text

    def _answer(self, text: str) -> str:
        """The answer's part of the detokenizer's ``text`` (which starts with ``after``)."""
        if text.startswith(self.before):
            return text[len(self.before) :]
        if self.before.startswith(text):
            return ""  # the prompt token's text is not out yet
        return text  # the answer completed a character the prompt's token began


def token_budget(context_length: int | None, window: int | None, n_prompt: int, max_tokens: int):
    """(max_tokens, capped): without a window an answer stops at the model's context."""
    if context_length and window is None:
        room = context_length - n_prompt
        if room < max_tokens:
            return max(room, 1), True
    return max_tokens, False
