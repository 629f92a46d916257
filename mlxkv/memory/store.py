"""Layouts kept on disk, keyed by config and mlx-lm version.

Probing imports MLX and builds mlx-lm's model (~0.3 s); the layout it yields depends only
on config.json and mlx-lm's source, so a repeated ``mlxkv plan`` reads it back as JSON.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

from mlxkv.errors import UserError
from mlxkv.files import MiB, atomic_write, parse_json, read_text
from mlxkv.memory.layout import Layout
from mlxkv.paths import home

LAYOUT_VERSION = 3  # bump when Layout's meaning changes


def _mlx_lm_version() -> str:
    """mlx-lm's version from its _version.py, without importing mlx_lm (2 s) or metadata."""
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return "?"
    try:
        text = (Path(list(spec.submodule_search_locations)[0]) / "_version.py").read_text()
    except OSError:
        return "?"
    return text.rsplit("__version__", 1)[-1].strip(" =\n\"'")


def _key(config: dict) -> str:
    mlx_lm = _mlx_lm_version()
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(f"{LAYOUT_VERSION}|{mlx_lm}|{text}".encode()).hexdigest()[:32]


def layout_for(config: dict) -> Layout:
    """The layout of ``config``: from disk when known, else probed (and saved)."""
    path = home() / "layouts" / f"{_key(config)}.json"
    try:
        text = read_text(path, 16 * MiB, "layouts cache")
        return Layout.from_dict(parse_json(text, "layouts cache"))
    except (UserError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        pass  # not there, or not usable: probe again and replace it
    from mlxkv.memory.probe import probe

    layout = probe(config)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(layout.to_dict()), what="layouts cache")
    except (OSError, UserError):
        pass  # a read-only home only costs the next run a probe
    return layout
