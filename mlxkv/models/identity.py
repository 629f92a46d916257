"""What makes two model folders the same model: a digest of config, tokenizer and weights.

A saved prompt cache holds keys and values computed by one model; it is only valid for
exactly that model, whatever its folder is called. The digest covers ``config.json``, the
tokenizer and chat-template files, and each weight file's size, safetensors header (names,
shapes, dtypes, offsets) and 64 blocks of 64 KiB spread over its data: a fine-tune changes
every tensor, a re-quantization changes the header. It reads a few MB whatever the size.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

from mlxkv.errors import UserError
from mlxkv.files import open_regular

_SMALL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                "generation_config.json")  # fmt: skip
_SMALL_LIMIT = 64 << 20
_HEAD = 16 << 20
_SAMPLES, _SAMPLE = 64, 64 << 10


def _digest_file(h, path: Path, whole: bool) -> None:
    f, size = open_regular(path, "model file")
    with f:
        h.update(f"{path.name}:{size}:".encode())
        if whole:
            if size > _SMALL_LIMIT:
                raise UserError(f"model file {path} is {size} bytes; too large for a tokenizer")
            h.update(f.read())
            return
        h.update(f.read(_HEAD))
        rest = size - _HEAD - _SAMPLE
        for i in range(_SAMPLES + 1) if rest > 0 else ():
            f.seek(_HEAD + rest * i // _SAMPLES)
            h.update(f.read(_SAMPLE))


@lru_cache(maxsize=16)
def _identity(folder: str, stamp: tuple) -> str:
    h = hashlib.sha256(b"mlxkv model identity 1\n")
    root = Path(folder)
    for name in _SMALL_FILES:
        if (root / name).exists():
            _digest_file(h, root / name, whole=True)
    for weights in sorted(root.glob("*.safetensors")):
        _digest_file(h, weights, whole=False)
    return h.hexdigest()[:32]


def model_identity(folder) -> str:
    """A digest naming the model in ``folder`` by its content (cached per process while
    the files keep their sizes and times)."""
    root = Path(folder).resolve()
    stamp = tuple(
        (p.name, st.st_size, st.st_mtime_ns)
        for p in sorted(root.iterdir())
        if p.is_file() and (st := p.stat())
    )
    return _identity(str(root), stamp)
