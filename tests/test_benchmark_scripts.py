"""Every benchmark script routes MLX to OpenBLAS before MLX is imported: ``import mlxkv``
changes nothing, and a script that imports MLX first measures the wheel's reference BLAS
(10-30x slower matmuls) without a word. A script that imports no MLX (it drives processes)
answers ``--help`` with every option it defines."""

from __future__ import annotations

import ast
import runpy
import sys
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


def _options(tree) -> list[str]:
    """The option strings of every ``add_argument`` call ("--rounds", ...)."""
    return [
        a.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "add_argument"
        for a in n.args
        if isinstance(a, ast.Constant) and str(a.value).startswith("-")
    ]


def _trees(mlx: bool) -> list:
    out = []
    for script in SCRIPTS:
        tree = ast.parse(script.read_text())
        if any(_imports_mlx(n) for n in ast.walk(tree)) == mlx:
            out.append(pytest.param(script, tree, id=script.name))
    return out


def test_every_script_is_checked_by_one_of_the_tests_below():
    assert len(_trees(True)) + len(_trees(False)) == len(SCRIPTS) > 0
    assert _trees(True) and _trees(False)


@pytest.mark.parametrize("script, tree", _trees(False))
def test_a_script_without_mlx_answers_help_with_its_options(script, tree, capsys, monkeypatch):
    """These drive subprocesses (the CLI sets its BLAS itself): each parses its flags and
    says what they are before it starts anything (run as ``python SCRIPT --help`` runs it,
    in this process)."""
    options = _options(tree)
    assert options, f"{script.name} defines no options"
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.syspath_prepend(str(script.parent))
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr()
    assert done.value.code == 0, out.err
    assert out.out.startswith("usage: ") and out.err == ""
    missing = [o for o in options if o not in out.out]
    assert missing == [], f"{script.name} --help does not name {missing}"
    # and MLX still works here: a script frees MLX's streams at exit (atexit), not as
    # its main() returns, or every later test in this process would fail
    import mlx.core as mx

    assert mx.add(mx.ones(2), 1).tolist() == [2.0, 2.0]


@pytest.mark.parametrize("script, tree", _trees(True))
def test_setup_blas_comes_before_mlx(script, tree):
    first_mlx = min(
        (n.lineno for n in ast.walk(tree) if _imports_mlx(n)),
    )
    setup = [n.lineno for n in tree.body if _calls_setup_blas(n)]
    assert setup, f"{script.name} imports MLX but never calls setup_blas() at module level"
    assert setup[0] < first_mlx, f"{script.name} imports MLX (line {first_mlx}) before setup_blas()"
