"""Fill-in-the-middle: the prompt a code model completes between a prefix and a suffix (an
editor's completion at the cursor), in the format its tokenizer was trained with.

A model has a format when its vocabulary holds that format's three marker tokens; the
formats are those of the code models mlx-lm runs (Qwen2.5/3-Coder and CodeGemma,
StarCoder 1/2, DeepSeek-Coder, Codestral). A model without one has no
fill-in-the-middle, and a request for it is refused rather than guessed at.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass


@dataclass(frozen=True)
class FimFormat:
    name: str  # the family the format comes from
    prefix: str
    suffix: str
    middle: str
    suffix_first: bool = False  # Codestral writes the suffix before the prefix
    separators: tuple[str, ...] = ()  # file and repository markers: the middle ended
    # the repository-level layout's markers: the repository's name, each file's path
    repo: str | None = None
    file_sep: str | None = None

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
        repo="<|repo_name|>",
        file_sep="<|file_sep|>",
    ),
    FimFormat(
        "starcoder",
        "<fim_prefix>",
        "<fim_suffix>",
        "<fim_middle>",
        separators=("<fim_pad>", "<file_sep>", "<filename>", "<reponame>"),
        repo="<reponame>",
        file_sep="<file_sep>",
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


# llama.cpp's /infill budgets, from its default batch of 2,048 tokens: the prefix's end,
# three quarters of it at most, the suffix's first quarter less the middle's start and two markers,
# and of the other files' text the last tokens that leave the batch and twice the answer
# free in the context.
INFILL_BATCH = 2048
# how far short of its budget the prefix may start, so that its start can stay put
PREFIX_SLACK = 512
SNIPPET = "\n\n--- snippet ---\n\n"  # between files, for a format without file markers


@dataclass(frozen=True)
class InfillText:
    prefix: str  # the text before the cursor's line (llama.cpp's input_prefix)
    suffix: str  # the text after the cursor
    middle: str = ""  # the cursor's line up to the cursor (its "prompt")
    files: tuple[tuple[str, str], ...] = ()  # (path, text) of other files, oldest first


def infill_ids(
    tokenizer, fmt: FimFormat, repo_level: bool, text: InfillText, answer: int, context
) -> tuple[list[int], bool]:
    """The token ids llama.cpp's /infill gives a model (its layout and budgets, each part
    tokenized alone; the prefix cut at a line, :func:`prefix_tail`), and whether a budget
    cut any part. ``repo_level``: the model has ``fmt``'s repository markers, so each file
    is written under its path (the repository named "myproject" and the cursor's file
    "filename", as llama.cpp names them); else the files' texts come one after another.
    ``answer``: the tokens the answer may take (-1: unbounded); ``context``: the model's
    (None: no limit)."""

    def enc(t: str) -> list[int]:
        return tokenizer.encode(t, add_special_tokens=False) if t else []

    def mark(marker: str) -> list[int]:
        return [tokenizer.convert_tokens_to_ids(marker)]

    files: list[int] = []
    if repo_level:
        files += mark(fmt.repo) + enc("myproject\n")
    for path, body in text.files:
        files += mark(fmt.file_sep) + enc(path + "\n") if repo_level else enc(SNIPPET)
        files += enc(body)
    if repo_level:
        files += mark(fmt.file_sep) + enc("filename\n")
    suffix, middle = enc(text.suffix), enc(text.middle)
    kept, cut = prefix_tail(enc, text.prefix, 3 * (INFILL_BATCH // 4))
    take_suffix = min(len(suffix), max(0, INFILL_BATCH // 4 - (2 + len(middle))))
    room = len(files) if context is None else max(0, context - INFILL_BATCH - 2 * answer)
    take_files = min(room, len(files))
    before = mark(fmt.prefix) + kept + middle
    after = mark(fmt.suffix) + suffix[:take_suffix]
    # the BOS the tokenizer itself adds to a text (CodeGemma's; Qwen's and StarCoder's none)
    lead = tokenizer.encode("", add_special_tokens=True)
    bos = lead if lead == [getattr(tokenizer, "bos_token_id", None)] else []
    ids = bos + files[len(files) - take_files :]
    ids += after + before if fmt.suffix_first else before + after + mark(fmt.middle)
    cut = cut or (take_suffix, take_files) != (len(suffix), len(files))
    return ids, cut


def prefix_tail(enc, text: str, budget: int) -> tuple[list[int], bool]:
    """The tokens of ``text``'s end that an infill prompt keeps, and whether that cut it:
    all of them within ``budget``, else from the start of a line chosen by content, so
    that it stays put as the cursor moves down and the next completion reuses the prefix
    from the prefix cache. Of the lines that leave between ``budget - PREFIX_SLACK`` and
    ``budget`` tokens: the earliest blank one, else the one whose text has the smallest
    CRC-32 (winnowing). llama.cpp keeps the last ``budget`` tokens, whose start moves with
    every new line; so does this when no line qualifies (one long line)."""
    ids = enc(text)
    if len(ids) <= budget:
        return ids, False
    lines = text.splitlines(keepends=True)
    counts = [len(enc(line)) for line in lines]
    scale = len(ids) / max(1, sum(counts))  # lines tokenized alone take more tokens
    left = len(ids)  # the tokens from this line on, near enough
    best, start = None, 0
    for line, n in zip(lines, counts, strict=True):
        if budget - PREFIX_SLACK <= left <= budget:
            key = (bool(line.strip()), zlib.crc32(line.encode()))
            if best is None or key < best[0]:
                best = (key, start)
        left, start = left - n * scale, start + len(line)
    tail = enc(text[best[1] :]) if best else []
    return (tail if 0 < len(tail) <= budget else ids[len(ids) - budget :]), True


def has_tokens(tokenizer, *texts: str | None) -> bool:
    """Whether each of ``texts`` is one token of ``tokenizer``'s vocabulary."""
    vocab = _vocab(tokenizer)
    return all(t is not None and t in vocab for t in texts)
