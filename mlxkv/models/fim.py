"""Fill-in-the-middle: the prompt a code model completes between a prefix and a suffix (an
editor's completion at the cursor), in the format its tokenizer was trained with.

A model has a format when its vocabulary holds that format's three marker tokens; the
formats are those of the code models mlx-lm runs (Qwen2.5/3-Coder and CodeGemma,
StarCoder 1/2, DeepSeek-Coder, Codestral). A model without one has no
fill-in-the-middle, and a request for it is refused rather than guessed at.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FimFormat:
    name: str  # the family the format comes from
    prefix: str
    suffix: str
    middle: str
    suffix_first: bool = False  # Codestral writes the suffix before the prefix
    separators: tuple[str, ...] = ()  # file and repository markers: the middle ended

    def prompt(self, before: str, after: str) -> str:
        """The text the model reads to write what goes between ``before`` and ``after``."""
        if self.suffix_first:
            return f"{self.suffix}{after}{self.prefix}{before}"
        return f"{self.prefix}{before}{self.suffix}{after}{self.middle}"

    @property
    def stops(self) -> tuple[str, ...]:
        """Marker texts that end the middle when the model writes one."""
        return (self.prefix, self.suffix, self.middle, *self.separators)


FORMATS = (
    FimFormat(
        "qwen",
        "<|fim_prefix|>",
        "<|fim_suffix|>",
        "<|fim_middle|>",
        separators=("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>"),
    ),
    FimFormat(
        "starcoder",
        "<fim_prefix>",
        "<fim_suffix>",
        "<fim_middle>",
        separators=("<fim_pad>", "<file_sep>", "<filename>", "<reponame>"),
    ),
    FimFormat("deepseek", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
    FimFormat("codestral", "[PREFIX]", "[SUFFIX]", "[MIDDLE]", suffix_first=True),
)


def fim_format(tokenizer) -> FimFormat | None:
    """The format whose three markers are tokens of ``tokenizer`` (None: none is)."""
    vocab = _vocab(tokenizer)
    for f in FORMATS:
        markers = (f.prefix, f.suffix) if f.suffix_first else (f.prefix, f.suffix, f.middle)
        if all(m in vocab for m in markers):
            return f
    return None


def _vocab(tokenizer) -> dict:
    inner = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper, or transformers'
    return inner.get_vocab()
