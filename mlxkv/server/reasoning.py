"""Reasoning: what a thinking model writes between its think markers (``<think>`` ...
``</think>`` for Qwen3 and DeepSeek-R1, as mlx-lm's tokenizer finds them), sent apart from
the answer as ``reasoning_content``, the field DeepSeek's API and llama.cpp's server use:
a client shows it as thinking, and a tool call the model sketches while thinking is not
taken for a call."""

from __future__ import annotations

from mlxkv.server.markers import pending


class ThinkReader:
    """Splits one answer's text, as it streams, into reasoning and content."""

    def __init__(self, start: str, end: str, inside: bool = False):
        self.start, self.end = start, end
        self.inside = inside  # the prompt itself opened the think block
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content that may be sent now."""
        self.buf += text
        thought, said = [], []
        while True:
            marker = self.end if self.inside else self.start
            i = self.buf.find(marker)
            if i < 0:
                keep = pending(self.buf, marker)
                (thought if self.inside else said).append(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
                break
            (thought if self.inside else said).append(self.buf[:i])
            self.buf = self.buf[i + len(marker) :]
            self.inside = not self.inside
        return "".join(thought), "".join(said)

    def close(self) -> tuple[str, str]:
        """At the answer's end: what was held, where it was going."""
        rest, self.buf = self.buf, ""
        return (rest, "") if self.inside else ("", rest)


def think_reader(tokenizer, prompt: str) -> ThinkReader | None:
    """A ThinkReader for one chat answer (None: the model has no think markers); the
    answer starts inside the block when ``prompt`` opened it (DeepSeek-R1's template)."""
    if not getattr(tokenizer, "has_thinking", False):
        return None
    start, end = tokenizer.think_start, tokenizer.think_end
    return ThinkReader(start, end, inside=prompt.rfind(start) > prompt.rfind(end))
