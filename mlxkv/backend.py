"""Facts about the MLX backend that change what is fast: BLAS on Linux, weight dtype.

The mlx-cpu wheel bundles netlib's *reference* BLAS (about 7 GFLOP/s for an fp32 matmul).
Loading an OpenBLAS with RTLD_GLOBAL before MLX is imported makes MLX's BLAS calls
(``cblas_sgemm``, unprefixed) resolve to it instead. Two sources, no apt needed for the
first: the ``cmeel-openblas`` wheel (a Linux dependency of mlxkv) and Debian's
``libopenblas0-pthread`` where installed.

Nothing happens on import: each entry point (the CLI, ``python -m mlxkv``, the test suite,
bench workers) calls :func:`setup_blas` before anything imports MLX. This module must not
import MLX.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import time
from pathlib import Path

from mlxkv.errors import UserError

OPENBLAS_INSTALL = "apt-get install libopenblas0-pthread"
CHOICES = ("auto", "reference", "cmeel", "system")
# auto: the first of these that loads. Order from docs/benchmarks.md (prefill, this machine).
AUTO_ORDER = ("cmeel", "system")
_state = {"blas": "reference", "threads": 1}


def system_openblas() -> Path | None:
    """Debian's OpenBLAS (``libopenblas0-pthread`` or ``-openmp``), if installed."""
    triplet = f"{platform.machine()}-linux-gnu"
    for flavour in ("openblas-pthread", "openblas-openmp"):
        lib = Path(f"/usr/lib/{triplet}/{flavour}/libblas.so.3")
        if lib.is_file():
            return lib
    return None


def cmeel_openblas() -> Path | None:
    """libopenblas.so from the ``cmeel-openblas`` wheel, if installed in this environment."""
    from importlib import metadata

    try:
        files = metadata.distribution("cmeel-openblas").files or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == "libopenblas.so.0" or f.name == "libopenblas.so":
            lib = Path(f.locate())
            if lib.is_file():
                return lib
    return None


def _find(source: str) -> Path | None:
    return system_openblas() if source == "system" else cmeel_openblas()


# OpenBLAS build targets whose kernels need more than baseline x86-64 (a wheel built
# without DYNAMIC_ARCH runs only its target's kernels: on a CPU without them, SIGILL).
_TARGET_FLAGS = {
    "SKYLAKEX": ("avx512f", "avx512bw", "avx512vl"),
    "COOPERLAKE": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
    "SAPPHIRERAPIDS": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
    "ZEN": ("avx2", "fma"),
    "HASWELL": ("avx2", "fma"),
    "SANDYBRIDGE": ("avx",),
}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def missing_cpu_features(lib: ctypes.CDLL) -> list[str]:
    """CPU features the OpenBLAS build of ``lib`` needs and this CPU lacks."""
    try:
        get_config = lib.openblas_get_config
    except AttributeError:  # not OpenBLAS: nothing known to check
        return []
    get_config.restype = ctypes.c_char_p
    config = (get_config() or b"").decode(errors="replace").split()
    if "DYNAMIC_ARCH" in config:
        return []
    need = next((flags for target, flags in _TARGET_FLAGS.items() if target in config), ())
    have = _cpu_flags()
    return [f for f in need if f not in have] if have else []


def others_running(reads: int = 5) -> int:
    """Tasks other than this process that want a CPU right now: the fewest runnable tasks
    in a few reads of /proc/loadavg (a passing blip is not a competitor), less this one.
    Unlike the load average, it forgets at once: the pip install before a first run is not
    counted against it."""
    counts = []
    for i in range(reads):
        try:
            counts.append(int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]))
        except (OSError, IndexError, ValueError):
            return 0
        if i + 1 < reads:
            time.sleep(0.002)
    return max(0, min(counts) - 1)


def default_threads() -> int:
    """OpenBLAS threads when the user sets none: the cores this process may use that other
    running tasks leave free, at least one; one under ``mlx.launch`` (MLX_RANK set), where
    the ranks on a host share its cores.

    On a quiet 2-core machine two threads prefill about 1.3x faster than one; beside one
    busy process, two threads ran 2x slower than one (docs/benchmarks.md#blas-threads)."""
    if os.environ.get("MLX_RANK") is not None:
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores - others_running())


def _load(lib: Path) -> str | None:
    """Load ``lib`` so its symbols serve MLX; None on success, else why not.

    Loaded privately first to ask OpenBLAS which CPU it was built for; made global (what
    routes MLX's calls to it) only when this CPU can run it. Unless the user set
    OPENBLAS_NUM_THREADS, its matmuls run on :func:`default_threads` threads."""
    # Counted before the library starts its own worker threads, which would count as busy.
    threads = None if os.environ.get("OPENBLAS_NUM_THREADS") else default_threads()
    try:
        private = ctypes.CDLL(str(lib), mode=os.RTLD_LOCAL)
    except OSError as e:
        return str(e)
    missing = missing_cpu_features(private)
    if missing:
        return f"built for CPUs with {', '.join(missing)}, which this CPU lacks"
    ctypes.CDLL(str(lib), mode=os.RTLD_GLOBAL)
    set_threads = getattr(private, "openblas_set_num_threads", None)
    if threads is not None and set_threads is not None:
        set_threads(threads)
    get_threads = getattr(private, "openblas_get_num_threads", None)
    _state["threads"] = get_threads() if get_threads is not None else 1
    return None


def setup_blas() -> str:
    """Route MLX's BLAS on Linux; returns the BLAS in use. Call before MLX is imported.

    ``MLXKV_BLAS``: ``auto`` (default: an OpenBLAS, see AUTO_ORDER, else the wheel's),
    ``reference`` (the mlx wheel's own), ``cmeel``, ``system`` or a library path.
    Raises UserError naming the variable when it asks for something that cannot load."""
    choice = os.environ.get("MLXKV_BLAS", "").strip() or "auto"
    if not sys.platform.startswith("linux"):
        _state["blas"] = "accelerate" if sys.platform == "darwin" else "reference"
        return _state["blas"]
    if "mlx.core" in sys.modules:  # too late: MLX already bound its BLAS symbols
        return _state["blas"]
    if choice == "reference":
        _state["blas"] = "reference"
        return _state["blas"]
    if choice == "auto":
        for source in AUTO_ORDER:
            lib = _find(source)
            if lib is not None and _load(lib) is None:
                _state["blas"] = str(lib)
                break
        return _state["blas"]
    if choice in ("cmeel", "system"):
        lib = _find(choice)
        if lib is None:
            how = "pip install cmeel-openblas" if choice == "cmeel" else OPENBLAS_INSTALL
            raise UserError(f"MLXKV_BLAS={choice}: that OpenBLAS is not installed ({how})")
    else:
        lib = Path(choice).expanduser()
        if not lib.is_file():
            raise UserError(
                f"MLXKV_BLAS={choice}: no such library; use one of {', '.join(CHOICES)} "
                "or the path of a BLAS .so"
            )
    why = _load(lib)
    if why:
        raise UserError(f"MLXKV_BLAS={choice}: cannot use {lib}: {why}")
    _state["blas"] = str(lib)
    return _state["blas"]


def blas() -> str:
    """The BLAS MLX's CPU matmuls go to: a library path, 'reference' or 'accelerate'."""
    return _state["blas"]


def blas_threads() -> int:
    """Threads the OpenBLAS in use runs its matmuls on; 1 where mlxkv loaded none."""
    return _state["threads"]
