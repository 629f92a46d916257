"""Exact admission: a request starts only when its KV reservation fits the memory budget.

Each request reserves the KV bytes the memory model predicts for its prompt plus its token
limit under its policy (a bounded policy caps it: a window never grows past its slots), and
what its caches hold beside them while it decodes: the sinks rotated ahead, and the undo
log a window keeps for drafts at its longest.
Rows of one batch share buffers padded to the longest row, so a batch reserves ``rows x``
its largest reservation (``mlxkv.memory.predictor.batch_allocated``). The scheduler starts
the next waiting request only while

    weights + runtime + reservations + kept prefixes <= budget

(the budget ``plan`` uses: ``--memory``, else what the machine has), evicting kept prefixes
before making a request wait. A request whose reservation cannot fit even alone is refused
with the numbers and what would fit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mlxkv.memory.budget import gib, largest
from mlxkv.policy import KVPolicy

SCORE_BYTES = 12  # per position and vocabulary entry of a scored prefill chunk


@dataclass(frozen=True)
class Fixed:
    """The bytes that do not depend on the requests."""

    weights: int
    runtime: int  # activations of one prefill chunk, logits of a full batch, overhead


class MemoryBudget:
    def __init__(
        self,
        loaded,
        budget: int | None,
        max_batch: int,
        chunk: int,
        layout=None,
        weights=None,
        draft_tokens: int = 0,
    ):
        """``layout`` and ``weights``: another share than this process holds (the largest
        rank's, where the ranks of a split model must decide alike); default its own.
        ``draft_tokens``: the scheduler's, whose window caches then keep an undo log."""
        from mlxkv.memory.dtypes import backend
        from mlxkv.memory.runtime import estimate

        self.loaded = loaded
        self.layout = layout or loaded.kv_layout
        self.dtype = loaded.dtype
        self.budget = budget
        self.chunk = chunk
        self.draft_tokens = draft_tokens
        context = loaded.context_length or 8192
        weights = loaded.weights_bytes if weights is None else weights
        rt = estimate(self.layout, context, 1, chunk, self.dtype, weights, 0, backend())
        # a batch's logits, or a draft step's (the drafts and the token before them)
        rows = max(max_batch, draft_tokens + 1)
        logits = rows * self.layout.facts.vocab_size * 4 * 2
        self.fixed = Fixed(weights, rt.activation_bytes + logits + rt.overhead_bytes)
        self._memo: dict[tuple[KVPolicy, int, int], int] = {}

    def reservation(self, policy: KVPolicy, tokens: int, rows: int = 1) -> int:
        """Peak KV bytes of ``rows`` sequences of ``tokens`` tokens under ``policy`` (and,
        for one, the sinks its decoding rotates ahead and its caches' undo log for drafts)."""
        from mlxkv.memory.predictor import KVPredictor

        key = (policy, tokens, rows)
        if key not in self._memo:
            p = KVPredictor(self.layout, policy, rows, self.dtype)
            scratch = p.decode_scratch(self.draft_tokens)
            self._memo[key] = p.prefill(tokens, self.chunk).peak_allocated + scratch
            if len(self._memo) > 4096:  # every prompt length is a new key: stay small
                self._memo.clear()
        return self._memo[key]

    def scoring(self, prompt: int, step: int) -> int:
        """Bytes a scored prefill (a prompt whose every token gets its logprob) holds beside
        its KV: one chunk's logits at every position, as the model gives them (float32 on
        the CPU) and their float32 log-softmax, and as much again for the partition."""
        return min(prompt, step) * self.layout.facts.vocab_size * SCORE_BYTES

    def base(self) -> int:
        return self.fixed.weights + self.fixed.runtime

    def never_fits(self, policy: KVPolicy, prompt: int, new: int, scoring: int = 0) -> str | None:
        """Why a request of ``prompt`` tokens and ``new`` answer tokens (and ``scoring``
        bytes of logits, for a scored prompt) cannot fit even alone (None when it can),
        with what would fit."""
        if self.budget is None:
            return None
        need = self.reservation(policy, prompt + new)
        room = self.budget - self.base()
        if need + scoring <= room:
            return None
        logits = f" and {gib(scoring)} of logits to score its prompt" if scoring else ""
        head = (
            f"this request needs {gib(need)} of KV cache ({prompt} prompt + {new} answer "
            f"tokens, {policy.describe()}){logits} but the memory budget {gib(self.budget)} "
            f"leaves {gib(max(room, 0))} after the weights ({gib(self.fixed.weights)}) and "
            f"runtime ({gib(self.fixed.runtime)})"
        )
        if scoring:  # the logits held are one prefill chunk's
            return head + "; raise --memory or serve with a smaller --prefill-step"
        return head + "; " + self._what_fits(policy, prompt, new, room)

    def _what_fits(self, policy: KVPolicy, prompt: int, new: int, room: int) -> str:
        if room <= 0:
            return "no request fits: raise --memory or serve a smaller model"
        ideas = []
        fewer = largest(lambda m: self.reservation(policy, prompt + m) <= room, 0, new)
        if fewer > 0 and self.reservation(policy, prompt + fewer) <= room:
            ideas.append(f"max_tokens <= {fewer}")
        if policy.bits is None:
            q = replace(policy, bits=4, key_bits=None, value_bits=None)
            if self.reservation(q, prompt + new) <= room:
                ideas.append('"kv": {"bits": 4}')
        if policy.window is None:
            sinks = 4

            def fits(w: int) -> bool:
                p = replace(policy, window=w, sinks=sinks)
                return self.reservation(p, prompt + new) <= room

            if fits(64):
                w = largest(fits, 64, prompt + new)
                ideas.append(f'"kv": {{"window": {w}, "sinks": {sinks}}}')
        if not ideas:
            return "nothing smaller fits: shorten the prompt or raise --memory"
        return "fits: " + ", or ".join(ideas)

    def status(self) -> dict:
        return {
            "budget_bytes": self.budget,
            "weights_bytes": self.fixed.weights,
            "runtime_bytes": self.fixed.runtime,
        }
