"""BLAS set-up: explicit at the entry points, MLXKV_BLAS honoured, unusable builds skipped."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mlxkv import backend


def _py(code: str, **env) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}
    )


MAPPED = (
    "import re; print(sorted(set(re.findall(r'\\S*blas\\S*', open('/proc/self/maps').read()))))"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux BLAS routing")
def test_import_mlxkv_loads_no_blas():
    out = _py("import mlxkv, mlxkv.cli; " + MAPPED)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux BLAS routing")
def test_cli_entry_point_sets_up_an_openblas():
    out = _py("from mlxkv.backend import setup_blas; print(setup_blas())", MLXKV_BLAS="")
    if backend.system_openblas() is None and backend.cmeel_openblas() is None:
        pytest.skip("no OpenBLAS installed")
    assert "openblas" in out.stdout, out.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux BLAS routing")
def test_reference_keeps_the_wheels_blas():
    code = "from mlxkv.backend import setup_blas; print(setup_blas()); " + MAPPED
    out = _py(code, MLXKV_BLAS="reference")
    first, maps = out.stdout.splitlines()
    assert first == "reference" and "openblas" not in maps


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux BLAS routing")
@pytest.mark.parametrize(
    "value, words", [("/nonexistent.so", "no such library"), ("/etc/hostname", "cannot use")]
)
def test_bad_mlxkv_blas_is_one_line_naming_the_variable(value, words):
    out = _py(
        "import sys; from mlxkv.cli import main; sys.exit(main(['models']))", MLXKV_BLAS=value
    )
    assert out.returncode == 2
    assert out.stderr.startswith(f"mlxkv: error: MLXKV_BLAS={value}") and words in out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


class _FakeOpenBLAS:
    """Stands in for a loaded library: only openblas_get_config is asked."""

    def __init__(self, config: bytes):
        self.openblas_get_config = lambda: config


@pytest.mark.parametrize(
    "config, flags, missing",
    [
        (b"OpenBLAS 0.3.31 NO_AFFINITY SKYLAKEX", {"avx2", "fma"}, ["avx512f", "avx512bw"]),
        (b"OpenBLAS 0.3.29 NO_AFFINITY ZEN", {"avx2", "fma"}, []),
        (b"OpenBLAS 0.3.29 NO_AFFINITY ZEN", {"avx"}, ["avx2", "fma"]),
        (b"OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY Haswell", {"sse2"}, []),
    ],
)
def test_builds_for_other_cpus_are_refused(monkeypatch, config, flags, missing):
    monkeypatch.setattr(backend, "_cpu_flags", lambda: flags)
    got = backend.missing_cpu_features(_FakeOpenBLAS(config))
    assert got[: len(missing)] == missing and bool(got) == bool(missing)
