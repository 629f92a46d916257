"""A scripted generator for the chat UI's tests: it satisfies ``tui.engine.ChatGenerator``
like the real ``Session`` (tests/test_tui_units.py checks both).

Deterministic text and KV figures, optional per-token delay; no MLX. Its KV figures are
made up (actual and predicted come from one formula): tests of the figures themselves run
on the real engine. Prompts containing ``!fail`` raise mid-answer.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from mlxkv.engine.events import Finished, PrefillProgress, Stats, TokenDelta
from mlxkv.errors import UserError
from mlxkv.policy import KVPolicy, PolicyError

BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M in float32
STEP = 256  # a full cache allocates in steps of 256 tokens, like mlx-lm's KVCache


def canned_answer(question: str) -> str:
    if "france" in question.lower():
        return "The capital of France is **Paris**."
    return (
        f"You asked: *{question.strip()[:40]}*.\n\n"
        "Here is some code:\n\n```python\nprint('hello from mlxkv')\n```\n\n"
        "- a window keeps the cache flat\n- a full cache grows\n\nDone."
    )


class FakeTokenizer:
    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(range(len(text) // 4))  # one token per 4 characters, as in run()


@dataclass
class FakeLoaded:
    name: str = "fake-135m"
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    context_length: int | None = 8192
    weights_bytes: int = 538_060_032
    dtype: str = "float32"
    config: dict = field(default_factory=dict)
    path: Path = Path("/nonexistent/fake-135m")  # no generation_config.json


class FakeKV:
    """KV figures for ``seen`` tokens under a policy (actual == predicted)."""

    def __init__(self, policy: KVPolicy):
        self.policy = policy
        self.seen = 0

    def snapshot(self, stats: Stats) -> Stats:
        p = self.policy
        kept = self.seen if p.kept_tokens is None else min(self.seen, p.kept_tokens)
        per = BYTES_PER_TOKEN if p.bits is None else BYTES_PER_TOKEN * (p.bits + 2) // 32
        allocated = (-(-kept // STEP) * STEP if p.window is None else kept) * per
        return replace(
            stats,
            kv_tokens=kept,
            kv_evicted=self.seen - kept,
            kv_tokens_seen=self.seen,
            kv_bytes_actual=allocated,
            kv_bytes_predicted=allocated,
            kv_bytes_logical=kept * per,
            active_memory=FakeLoaded.weights_bytes + allocated + 50_000_000,
            peak_memory=FakeLoaded.weights_bytes + allocated + 80_000_000,
            weights_bytes=FakeLoaded.weights_bytes,
        )


class FakeGenerator:
    def __init__(self, name="fake-135m", policy: KVPolicy | None = None, delay: float = 0.0):
        self.loaded = FakeLoaded(name=name)
        self.policy = policy or KVPolicy()
        self.delay = delay
        self._cancel = threading.Event()
        self.runs: list[str] = []  # prompts seen (tests look at them)
        self.reset()

    def reset(self) -> None:
        self.kv = FakeKV(self.policy)
        self.cached = ""

    def set_policy(self, policy: KVPolicy) -> None:
        if policy.window is not None and policy.window < 16:
            raise PolicyError(f"window {policy.window} is below the fake model's minimum of 16")
        self.policy = policy
        self.reset()

    def cancel(self) -> None:
        self._cancel.set()

    def stats(self) -> Stats:
        return self._stats(0, 0)

    def _stats(self, n_prompt, n_gen, reason=None) -> Stats:
        return self.kv.snapshot(
            Stats(
                prompt_tokens=n_prompt,
                generation_tokens=n_gen,
                prompt_tps=100.0,
                generation_tps=10.0,
                context_limit=self.loaded.context_length,
                policy=self.policy.describe(),
                finish_reason=reason,
            )
        )

    def check_prompt_length(self, characters: int) -> None:
        """As Session's: more characters than 16 per token of the context is refused."""
        if characters > 16 * self.loaded.context_length:
            raise UserError(f"the prompt is {characters} characters, more than the context holds")

    def run(self, prompt_text: str, settings):
        """Yields the same kinds of events as Session.run."""
        if not prompt_text:
            raise UserError("the prompt is empty; type something to send")
        self._cancel.clear()
        self.runs.append(prompt_text)
        if not prompt_text.startswith(self.cached):
            self.reset()
        n_prompt = max(1, (len(prompt_text) - len(self.cached)) // 4)
        self.kv.seen += n_prompt
        yield PrefillProgress(n_prompt, n_prompt)
        question = prompt_text.rsplit("<|user|>", 1)[-1].split("\n<|")[0]
        pieces = re.findall(r"\s*\S+|\s+", canned_answer(question))[: settings.max_tokens]
        text, reason, n = "", "stop", 0
        for i, piece in enumerate(pieces):
            if "!fail" in question and i == 2:
                raise RuntimeError("the fake model failed mid-answer")
            if self.delay:
                time.sleep(self.delay)
            text += piece
            n += 1
            self.kv.seen += 1
            yield TokenDelta(piece, i, self._stats(n_prompt, i + 1))
            if self._cancel.is_set():
                reason = "cancelled"
                break
        self.cached = prompt_text + text
        yield Finished(text, reason, self._stats(n_prompt, n, reason))


def fake_opener(delay: float = 0.0, known=("fake-135m", None)):
    """An opener for tui.engine.ChatEngine; unknown model names fail like the real one."""

    def open_generator(model, policy, on_status, on_progress):
        on_status(f"loading {model or 'fake-135m'} ...")
        if model not in known:
            raise UserError(f"unknown model {model!r}: not a folder, file or registry alias")
        gen = FakeGenerator(name=model or "fake-135m", delay=delay)
        gen.set_policy(policy)
        return gen

    return open_generator
