"""Facts about the MLX backend that change what is fast: BLAS on Linux, weight dtype.

The mlx-cpu wheel bundles netlib's *reference* BLAS (about 7 GFLOP/s for an fp32 matmul).
Loading an OpenBLAS with RTLD_GLOBAL before MLX is imported makes MLX's BLAS calls
(``cblas_sgemm``, unprefixed) resolve to it instead. Sources, in the order ``auto`` tries
them: the ``ngsolve-openblas`` wheel (a Linux x86-64 dependency of mlxkv; no apt step), the
``cmeel-openblas`` wheel where installed, Debian's ``libopenblas0-pthread`` where installed.

Both wheels' OpenBLAS need the Fortran runtime (``libgfortran.so.5``), which a fresh
machine does not have; the mlx-cpu and numpy wheels each bundle one under a hashed name.
ngsolve-openblas looks for its runtime beside itself (RPATH ``$ORIGIN``), so mlxkv loads it
through a private temporary folder of symlinks that puts a bundled runtime there under the
name the library asks for (:func:`_load_beside_runtime`). cmeel-openblas has no RPATH and
loads only where the system has the runtime. ``scipy-openblas32`` needs no Fortran but
exports prefixed names (``scipy_cblas_sgemm``) that MLX cannot bind to: refused below.

Nothing happens on import: each entry point (the CLI, ``python -m mlxkv``, the test suite,
bench workers) calls :func:`setup_blas` before anything imports MLX, and a process's entry
point has :func:`free_streams` run at exit (``atexit``). This module must not import MLX.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from mlxkv.errors import UserError

OPENBLAS_INSTALL = "apt-get install libopenblas0-pthread"
WHEEL_INSTALL = "pip install 'ngsolve-openblas==0.3.33.post1'"
CHOICES = ("auto", "reference", "ngsolve", "cmeel", "system")
# auto: the first of these that loads. Order from docs/benchmarks.md#blas-prefill-speed.
AUTO_ORDER = ("ngsolve", "cmeel", "system")
_state = {"blas": "reference", "threads": 1}


def system_openblas() -> Path | None:
    """Debian's OpenBLAS (``libopenblas0-pthread`` or ``-openmp``), if installed."""
    triplet = f"{platform.machine()}-linux-gnu"
    for flavour in ("openblas-pthread", "openblas-openmp"):
        lib = Path(f"/usr/lib/{triplet}/{flavour}/libblas.so.3")
        if lib.is_file():
            return lib
    return None


def _wheel_file(dist: str, prefix: str, marker: str = ".so") -> Path | None:
    """The first file of installed distribution ``dist`` whose name starts with ``prefix``
    and contains ``marker``, or None."""
    from importlib import metadata

    try:
        files = metadata.distribution(dist).files or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name.startswith(prefix) and marker in f.name:
            lib = Path(f.locate())
            if lib.is_file():
                return lib
    return None


def cmeel_openblas() -> Path | None:
    """libopenblas.so from the ``cmeel-openblas`` wheel, if installed in this environment."""
    return _wheel_file("cmeel-openblas", "libopenblas.so")


def ngsolve_openblas() -> Path | None:
    """libopenblasp-r*.so from the ``ngsolve-openblas`` wheel (DYNAMIC_ARCH), if installed."""
    return _wheel_file("ngsolve-openblas", "libopenblas")


def fortran_runtime() -> Path | None:
    """A ``libgfortran.so.5`` that a wheel of this environment bundles (mlx-cpu, numpy)."""
    for dist in ("mlx-cpu", "numpy"):
        lib = _wheel_file(dist, "libgfortran", ".so.5")
        if lib is not None:
            return lib
    return None


def _find(source: str) -> Path | None:
    return {"ngsolve": ngsolve_openblas, "cmeel": cmeel_openblas, "system": system_openblas}[
        source
    ]()


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


LOADAVG = Path("/proc/loadavg")  # its 4th field: runnable tasks / all tasks


def others_running(reads: int = 5) -> int:
    """Tasks other than this process that want a CPU right now: the fewest runnable tasks
    in a few reads of /proc/loadavg (a passing blip is not a competitor), less this one.
    Unlike the load average, it forgets at once: the pip install before a first run is not
    counted against it."""
    counts = []
    for i in range(reads):
        try:
            counts.append(int(LOADAVG.read_text().split()[3].split("/")[0]))
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


def _load(lib: Path, beside: Path | None = None) -> str | None:
    """Load ``lib`` so its symbols serve MLX; None on success, else why not.

    Loaded privately first to ask OpenBLAS which CPU it was built for; made global (what
    routes MLX's calls to it) only when this CPU can run it and it exports the unprefixed
    ``cblas_sgemm`` MLX calls. ``beside``: a Fortran runtime to put beside it while it loads
    (:func:`_load_beside_runtime`). Unless the user set OPENBLAS_NUM_THREADS, its matmuls
    run on :func:`default_threads` threads."""
    # Counted before the library starts its own worker threads, which would count as busy.
    threads = None if os.environ.get("OPENBLAS_NUM_THREADS") else default_threads()
    if beside is not None:
        return _load_beside_runtime(lib, beside, threads)
    return _load_as(lib, threads)


def _load_as(lib: Path, threads: int | None) -> str | None:
    try:
        private = ctypes.CDLL(str(lib), mode=os.RTLD_LOCAL)
    except OSError as e:
        return str(e)
    if not hasattr(private, "cblas_sgemm"):
        return "it exports no cblas_sgemm, the name MLX calls (a prefixed build?)"
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


def _load_beside_runtime(lib: Path, runtime: Path, threads: int | None) -> str | None:
    """Load ``lib``, whose RPATH is ``$ORIGIN``, with the Fortran runtime ``runtime`` found
    beside it: a new private folder holds symlinks to ``lib``, to ``runtime`` as
    ``libgfortran.so.5`` and to the files next to ``runtime`` (libquadmath, under the hashed
    name the runtime asks for). The loader resolves ``$ORIGIN`` without following symlinks,
    so it finds them there. The folder is removed once loaded; the loaded libraries stay,
    and MLX's own LAPACK later finds that runtime already loaded under its own name."""
    try:
        links = {p.name: p for p in runtime.parent.iterdir() if p.is_file()}
        links.setdefault("libgfortran.so.5", runtime)
        links[lib.name] = lib
        folder = Path(tempfile.mkdtemp(prefix="mlxkv-blas-"))
    except OSError as e:
        return f"cannot set up its Fortran runtime ({e})"
    try:
        for name, target in links.items():
            (folder / name).symlink_to(target)
        why = _load_as(folder / lib.name, threads)
    except OSError as e:
        why = f"cannot set up its Fortran runtime ({e})"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return why.replace(str(folder / lib.name), str(lib)) if why else None


def _fallback_line(reasons: list[str]) -> str:
    """The one stderr line that says MLX runs on the reference BLAS, why, and the fix."""
    why = "; ".join(reasons) if reasons else "no OpenBLAS is installed"
    fix = WHEEL_INSTALL if platform.machine() == "x86_64" else OPENBLAS_INSTALL
    return (
        f"mlxkv: warning: MLX's CPU matmuls use the reference BLAS, about 20x slower ({why}); "
        f"fix: {fix} (MLXKV_BLAS=reference hides this line)"
    )


def setup_blas() -> str:
    """Route MLX's BLAS on Linux; returns the BLAS in use. Call before MLX is imported.

    ``MLXKV_BLAS``: ``auto`` (default: an OpenBLAS, see AUTO_ORDER, else the reference BLAS
    with one line on stderr that says why), ``reference`` (the mlx wheel's own),
    ``ngsolve``, ``cmeel``, ``system`` or a library path. Raises UserError naming the
    variable when it asks for something that cannot load."""
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
        reasons = []
        for source in AUTO_ORDER:
            lib = _find(source)
            why = None if lib is None else _load(lib, _runtime_for(source))
            if lib is not None and why is None:
                _state["blas"] = str(lib)
                return _state["blas"]
            if lib is not None:
                reasons.append(f"{source}: {why}")
        print(_fallback_line(reasons), file=sys.stderr)
        return _state["blas"]
    if choice in ("ngsolve", "cmeel", "system"):
        lib = _find(choice)
        if lib is None:
            how = {"ngsolve": WHEEL_INSTALL, "cmeel": "pip install cmeel-openblas"}
            raise UserError(
                f"MLXKV_BLAS={choice}: that OpenBLAS is not installed "
                f"({how.get(choice, OPENBLAS_INSTALL)})"
            )
    else:
        lib = Path(choice).expanduser()
        if not lib.is_file():
            raise UserError(
                f"MLXKV_BLAS={choice}: no such library; use one of {', '.join(CHOICES)} "
                "or the path of a BLAS .so"
            )
    why = _load(lib, _runtime_for(choice))
    if why:
        raise UserError(f"MLXKV_BLAS={choice}: cannot use {lib}: {why}")
    _state["blas"] = str(lib)
    return _state["blas"]


def _runtime_for(source: str) -> Path | None:
    """The bundled Fortran runtime to load ``source``'s library beside, if it takes one."""
    return fortran_runtime() if source == "ngsolve" else None


def blas() -> str:
    """The BLAS MLX's CPU matmuls go to: a library path, 'reference' or 'accelerate'."""
    return _state["blas"]


def blas_threads() -> int:
    """Threads the OpenBLAS in use runs its matmuls on; 1 where mlxkv loaded none."""
    return _state["threads"]


def free_streams() -> None:
    """Free this thread's MLX streams: the last MLX call of a thread or process.

    MLX (>= 0.31) asks for ``mx.clear_streams()`` on every thread that used it before the
    thread or process ends; without it a process exits through MLX's static destructors
    and now and then aborts after its last line ("terminate called without an active
    exception", exit 134): 4 of 20 runs of ``mlxkv generate`` refusing a crafted
    ``--prompt-cache`` here, 0 of 20 with it. The thread's streams cannot be used
    afterwards, so a process's entry point registers this with ``atexit`` rather than
    calling it: code run in a process that goes on (a test running a script's
    ``__main__``) must not take MLX away from it. A no-op where MLX was never imported.
    """
    mx = sys.modules.get("mlx.core")
    if mx is not None:
        mx.clear_streams()


def release_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``).

    On the CPU backend MLX's buffers come from ``malloc``; glibc keeps the pages freed
    buffers held (in each thread's arena), so a Linux server's resident memory stayed
    hundreds of MiB above what MLX held once its longest prompts had come and gone
    (docs/serve.md, the soak). Called when the engine goes idle; about 10 ms. A no-op
    where the C library has no ``malloc_trim`` (macOS, where MLX's buffers are Metal's, or
    musl)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim
