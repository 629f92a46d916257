"""A token stream from any UTF-8 text file, long enough for the longest stream asked for."""

from __future__ import annotations

from pathlib import Path

from mlxkv.errors import UserError


def read_text(path: str | Path) -> str:
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"--text {p}: no such file") from None
    except UnicodeDecodeError as e:
        raise UserError(f"--text {p} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise UserError(f"--text {p}: {e.strerror}") from None
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
