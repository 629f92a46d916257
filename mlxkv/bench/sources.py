"""The team's benchmark scripts in the source tree (``benchmarks/*.py``), imported by path.

They are not part of the installed package (no ``benchmarks`` package on sys.path), so a
section that reuses one is skipped, with a message, when it is absent.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
_loaded: dict[str, ModuleType] = {}


def script(name: str) -> ModuleType | None:
    """``benchmarks/<name>.py`` as a module, or None if this is not a source checkout."""
    if name in _loaded:
        return _loaded[name]
    path = BENCHMARKS / f"{name}.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(f"mlxkv_bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    _loaded[name] = mod
    return mod
