"""The ``--metrics PATH`` file of UI timings: checked before the screen opens, then replaced
whole (atomically) after each turn. Only a file of this kind is ever replaced: any other
existing file is the user's and is refused."""

from __future__ import annotations

import json
from pathlib import Path

from mlxkv.errors import UserError
from mlxkv.files import MiB, atomic_write, parse_json, read_text

MARK = "panel_renders"  # a key every metrics file holds
MAX_BYTES = 16 * MiB  # a metrics file is a few KB; a larger one is not ours


def check_metrics_path(path: str | None) -> Path | None:
    """``PATH`` if the chat may write its timings there, else a one-line ``UserError``."""
    if not path:
        return None
    p = Path(path).expanduser()
    if p.is_dir():
        raise UserError(f"--metrics {p} is a folder; give a file path, e.g. {p}/metrics.json")
    if not p.parent.is_dir():
        raise UserError(f"--metrics {p}: folder {p.parent} does not exist; create it first")
    if p.exists() and not p.is_file():
        raise UserError(f"--metrics {p} is not a regular file; give a file path")
    if p.exists() and not _is_metrics(p):
        raise UserError(
            f"--metrics {p} exists and is not a metrics file written by mlxkv chat; "
            "give a new path (the file is left as it is)"
        )
    return p


def _is_metrics(p: Path) -> bool:
    try:
        data = parse_json(read_text(p, MAX_BYTES, "--metrics"), "--metrics")
    except UserError:
        return False
    return isinstance(data, dict) and MARK in data and isinstance(data.get("turns"), list)


def write_metrics(path: Path, data: dict) -> None:
    atomic_write(path, json.dumps(data, indent=2), "--metrics")
