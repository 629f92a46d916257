"""Every benchmark script routes MLX to OpenBLAS before MLX is imported: ``import mlxkv``
changes nothing, and a script that imports MLX first measures the wheel's reference BLAS
(10-30x slower matmuls) without a word."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).parent.parent / "benchmarks").glob("*.py"))


def _imports_mlx(node) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] in ("mlx", "mlx_lm") for a in node.names)
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").split(".")[0] in ("mlx", "mlx_lm")
    return False


def _calls_setup_blas(node) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and getattr(node.value.func, "id", None) == "setup_blas"
    )


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_setup_blas_comes_before_mlx(script):
    tree = ast.parse(script.read_text())
    if not any(_imports_mlx(n) for n in ast.walk(tree)):
        return  # drives subprocesses (the CLI sets its BLAS itself)
    first_mlx = min(
        (n.lineno for n in ast.walk(tree) if _imports_mlx(n)),
    )
    setup = [n.lineno for n in tree.body if _calls_setup_blas(n)]
    assert setup, f"{script.name} imports MLX but never calls setup_blas() at module level"
    assert setup[0] < first_mlx, f"{script.name} imports MLX (line {first_mlx}) before setup_blas()"
