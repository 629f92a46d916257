"""Shared by the bad-input test modules: run the CLI in process, check the one-line error."""

from __future__ import annotations

import shutil
from pathlib import Path

from mlxkv.cli import main


def snapshot(*paths: Path) -> dict:
    """Bytes of every file under ``paths`` (to compare after a refused run)."""
    out = {}
    for p in paths:
        files = [p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file())
        out.update({f: f.read_bytes() for f in files})
    return out


def refused(capsys, *argv: str, code: int = 2) -> str:
    """Run ``mlxkv ARGV``; assert exit ``code`` and exactly one error line, no traceback."""
    assert main(list(argv)) == code
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if ": error: " in x]
    assert len(lines) == 1, err
    assert "Traceback" not in err and lines[0].startswith("mlxkv")
    return lines[0]


def truncated_copy(model: Path, folder: Path) -> Path:
    """``model`` copied into ``folder`` with its weights cut at 1 MiB (an interrupted
    download)."""
    folder.mkdir()
    for f in model.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, folder / f.name)
    with open(model / "model.safetensors", "rb") as src:
        (folder / "model.safetensors").write_bytes(src.read(1 << 20))
    return folder
