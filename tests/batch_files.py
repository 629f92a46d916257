"""Writing batch inputs and reading batch outputs in tests."""

from __future__ import annotations

import json
from pathlib import Path


def write_lines(path: Path, lines) -> Path:
    """One JSON value (or a raw string, written as it is) per line."""
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def read_records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]
