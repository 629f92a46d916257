"""BLAS set-up: explicit at the entry points, MLXKV_BLAS honoured, unusable builds skipped."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlxkv import backend


def _py(code: str, drop: tuple[str, ...] = (), **env) -> subprocess.CompletedProcess:
    full = {**{k: v for k, v in os.environ.items() if k not in drop}, **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full)


def _any_openblas() -> bool:
    return any(backend._find(source) is not None for source in backend.AUTO_ORDER)


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
    if not _any_openblas():
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


@pytest.mark.parametrize(
    "cores, others, rank, threads",
    [(2, 0, None, 2), (2, 1, None, 1), (2, 6, None, 1), (8, 2, None, 6), (8, 0, "0", 1)],
)
def test_default_threads_are_the_idle_cores(monkeypatch, cores, others, rank, threads):
    monkeypatch.setattr(backend.os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(backend, "others_running", lambda: others)
    if rank is None:
        monkeypatch.delenv("MLX_RANK", raising=False)
    else:
        monkeypatch.setenv("MLX_RANK", rank)
    assert backend.default_threads() == threads


THREADS = (
    "import os; from mlxkv import backend; {patch}backend.setup_blas(); "
    "import ctypes; lib = ctypes.CDLL(backend.blas()); "
    "print(backend.blas_threads(), lib.openblas_get_num_threads())"
)


def _threads(patch: str = "", **env) -> str:
    if not _any_openblas():
        pytest.skip("no OpenBLAS installed")
    out = _py(THREADS.format(patch=patch), drop=("OPENBLAS_NUM_THREADS", "MLX_RANK"), **env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux BLAS routing")
def test_a_quiet_machine_gets_a_thread_per_core():
    cores = len(os.sched_getaffinity(0))
    quiet = "backend.others_running = lambda: 0; "
    assert _threads(quiet, MLXKV_BLAS="") == f"{cores} {cores}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux BLAS routing")
def test_ranks_under_mlx_launch_get_one_thread():
    quiet = "backend.others_running = lambda: 0; "
    assert _threads(quiet, MLXKV_BLAS="", MLX_RANK="1") == "1 1"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux BLAS routing")
def test_openblas_num_threads_wins():
    busy = "backend.others_running = lambda: 9; "
    assert _threads(busy, MLXKV_BLAS="", OPENBLAS_NUM_THREADS="2") == "2 2"


@pytest.mark.parametrize(
    "loadavg, others",
    [
        ("0.00 0.01 0.05 1/93 4242\n", 0),  # only the reader itself is running
        ("3.10 2.00 1.50 4/120 4242\n", 3),
        ("0.50 0.40 0.30 0/90 4242\n", 0),  # never below zero
        ("0.50 0.40\n", 0),  # unreadable: assume a quiet machine
        ("0.50 0.40 0.30 x/90 4242\n", 0),
        (None, 0),  # no such file (not Linux)
    ],
)
def test_others_running_is_the_runnable_count_less_this_process(
    tmp_path, monkeypatch, loadavg, others
):
    path = tmp_path / "loadavg"
    if loadavg is not None:
        path.write_text(loadavg)
    monkeypatch.setattr(backend, "LOADAVG", path)
    assert backend.others_running() == others


# What a process maps after setup_blas(): the BLAS in use, then every BLAS, LAPACK and Fortran
# runtime file the loader found for it (real paths: /proc/self/maps resolves symlinks).
PICKED = (
    "import re; from mlxkv.backend import setup_blas; print(setup_blas()); "
    "print('\\n'.join(sorted(set(re.findall(r'/\\S*(?:blas|lapack|gfortran|quadmath)\\S*', "
    "open('/proc/self/maps').read())))))"
)
WHEEL_PLATFORM = sys.platform.startswith("linux") and platform.machine() == "x86_64"


@pytest.mark.skipif(not WHEEL_PLATFORM, reason="the OpenBLAS wheel is a Linux x86-64 dependency")
def test_the_picked_openblas_and_its_fortran_runtime_come_from_wheels():
    """What a fresh machine lacks (Debian's libgfortran5, libopenblas0) must not be what
    makes the BLAS load: every library the loader found for it lies in this environment."""
    out = _py(PICKED, MLXKV_BLAS="")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    picked, *mapped = out.stdout.splitlines()
    assert "openblas" in picked and picked != "reference"
    assert any("gfortran" in m for m in mapped), mapped  # the runtime it needs came along
    prefix = str(Path(sys.prefix).resolve())
    outside = [m for m in mapped if not str(Path(m).resolve()).startswith(prefix)]
    assert outside == [], f"loaded from the system, absent on a fresh machine: {outside}"


def _fresh_libs() -> Path | None:
    """shared/tools/fresh-libs beside the repository (or beside its worktree folder)."""
    for up in Path(__file__).resolve().parents[1:4]:
        tool = up / "shared" / "tools" / "fresh-libs"
        if tool.is_file():
            return tool
    return None


@pytest.mark.skipif(not WHEEL_PLATFORM, reason="the OpenBLAS wheel is a Linux x86-64 dependency")
def test_a_fresh_machine_gets_an_openblas():
    """Debian's OpenBLAS and Fortran runtime hidden, as on a newcomer's machine."""
    tool = _fresh_libs()
    if tool is None:
        pytest.skip("no shared/tools/fresh-libs here")
    cmd = ["bash", str(tool), sys.executable, "-c", PICKED]
    env = {**os.environ, "MLXKV_BLAS": ""}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode == 3:
        pytest.skip(out.stderr.strip())
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert "openblas" in out.stdout.splitlines()[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux BLAS routing")
@pytest.mark.parametrize(
    "find, why",
    [
        ("lambda source: None", "(no OpenBLAS is installed)"),
        ("lambda source: Path('/etc/hostname')", "(ngsolve: /etc/hostname: "),
    ],
)
def test_falling_back_to_the_reference_blas_says_why_in_one_line(find, why):
    code = (
        "import sys; from pathlib import Path; from mlxkv import backend; "
        f"backend._find = {find}; from mlxkv.cli import main; sys.exit(main(['models']))"
    )
    out = _py(code, MLXKV_BLAS="")
    assert out.returncode == 0
    line, *rest = out.stderr.splitlines()
    assert rest == [] and "Traceback" not in out.stderr
    assert (
        line.startswith("mlxkv: warning: MLX's CPU matmuls use the reference BLAS") and why in line
    )
    assert "fix: " in line and "MLXKV_BLAS=reference hides this line" in line
    quiet = _py(code, MLXKV_BLAS="reference")
    assert quiet.returncode == 0 and quiet.stderr == ""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux BLAS routing")
def test_a_library_without_unprefixed_cblas_is_refused():
    """A real library that loads but cannot serve MLX's cblas_sgemm (as scipy-openblas32's
    scipy_cblas_sgemm cannot) is refused, not reported as the BLAS in use."""
    libm = next(m for m in re.findall(r"/\S*/libm\.so\.6", Path("/proc/self/maps").read_text()))
    out = _py("import sys; from mlxkv.cli import main; sys.exit(main(['models']))", MLXKV_BLAS=libm)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert out.stderr.startswith(f"mlxkv: error: MLXKV_BLAS={libm}: cannot use ")
    assert "exports no cblas_sgemm" in out.stderr


@pytest.mark.skipif(not WHEEL_PLATFORM, reason="the OpenBLAS wheel is a Linux x86-64 dependency")
@pytest.mark.parametrize("dist", ["mlx-cpu", "numpy"])
def test_either_wheels_fortran_runtime_serves(dist):
    """The runtime comes from the mlx-cpu wheel, else numpy's: each one loads the OpenBLAS."""
    if backend._wheel_file(dist, "libgfortran", ".so.5") is None:
        pytest.skip(f"{dist} bundles no libgfortran here")
    code = (
        "from mlxkv import backend; "
        f"backend.fortran_runtime = lambda: backend._wheel_file({dist!r}, 'libgfortran', '.so.5'); "
        + PICKED
    )
    out = _py(code, MLXKV_BLAS="")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    picked, *mapped = out.stdout.splitlines()
    assert "ngsolve_openblas" in picked
    fortran = [m for m in mapped if "gfortran" in m]
    libs = dist.replace("-", "_") + ".libs"
    assert fortran and all(f"/{libs}/" in m for m in fortran), fortran


@pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's heap"
)
def test_release_heap_gives_freed_heap_pages_back(tmp_path):
    """Blocks freed between blocks still in use stay resident until ``release_heap``."""
    script = tmp_path / "heap.py"
    script.write_text(
        "import ctypes\n"
        "from mlxkv.backend import release_heap\n"
        "libc = ctypes.CDLL(None)\n"
        "libc.malloc.restype = ctypes.c_void_p\n"
        "libc.free.argtypes = [ctypes.c_void_p]\n"
        "def rss():\n"
        "    line = next(x for x in open('/proc/self/status') if x.startswith('VmRSS'))\n"
        "    return int(line.split()[1]) // 1024\n"
        "blocks = [libc.malloc(64 * 1024) for _ in range(3000)]\n"
        "for b in blocks:\n"
        "    ctypes.memset(b, 1, 64 * 1024)\n"
        "for b in blocks[::2]:\n"
        "    libc.free(b)\n"
        "held = rss()\n"
        "release_heap()\n"
        "print(held, rss())\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    held, after = map(int, out.stdout.split())
    assert held - after > 80, out.stdout  # of the 94 MiB the freed blocks took
