"""A token stream from any UTF-8 text file, long enough for the longest stream asked for."""

from __future__ import annotations

from pathlib import Path

from mlxkv import files
from mlxkv.errors import UserError

TEXT_LIMIT = 256 << 20  # bytes of --text; a long stream needs a few MB


def read_text(path: str | Path) -> str:
    """The UTF-8 text of ``path``: a regular file of at most TEXT_LIMIT bytes."""
    p = Path(path).expanduser()
    text = files.read_text(p, TEXT_LIMIT, "--text")
    if not text.strip():
        raise UserError(f"--text {p} is empty")
    return text


def token_stream(tokenizer, text: str, n_tokens: int) -> tuple[list[int], bool]:
    """The first ``n_tokens`` tokens of ``text`` (BOS first, when the tokenizer has one);
    the text is repeated if it is too short. Returns (ids, repeated)."""
    # Tokenize only what is needed: ~4 chars per token with a wide margin.
    head = text[: max(8 * n_tokens, 4096)]
    ids = tokenizer.encode(head, add_special_tokens=True)
    repeated = False
    while len(ids) < n_tokens + 1:
        repeated = True
        ids += tokenizer.encode("\n\n" + head, add_special_tokens=False)
    return ids[: n_tokens + 1], repeated  # +1: the last position needs a target
