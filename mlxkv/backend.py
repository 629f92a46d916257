"""Facts about the MLX backend that change what is fast: BLAS on Linux, weight dtype.

The mlx-cpu wheel bundles netlib's *reference* BLAS (about 7 GFLOP/s for an fp32 matmul).
Loading Debian's OpenBLAS with RTLD_GLOBAL before MLX is imported makes MLX's BLAS calls
resolve to it instead (10-30x faster). This module must not import MLX at module level.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from pathlib import Path

OPENBLAS_INSTALL = "apt-get install libopenblas0-pthread"
_state = {"blas": "reference"}


def _openblas_candidates() -> list[Path]:
    triplet = f"{platform.machine()}-linux-gnu"
    return [
        Path(f"/usr/lib/{triplet}/openblas-pthread/libblas.so.3"),
        Path(f"/usr/lib/{triplet}/openblas-openmp/libblas.so.3"),
    ]


def preload_fast_blas() -> str:
    """Make MLX use OpenBLAS on Linux when it is installed; returns the BLAS in use.

    ``MLXKV_BLAS=reference`` keeps the wheel's BLAS; ``MLXKV_BLAS=/path/libblas.so.3``
    names another library.
    """
    choice = os.environ.get("MLXKV_BLAS", "")
    if not sys.platform.startswith("linux") or choice == "reference":
        _state["blas"] = "accelerate" if sys.platform == "darwin" else "reference"
        return _state["blas"]
    if "mlx.core" in sys.modules:  # too late: MLX already bound its BLAS symbols
        return _state["blas"]
    candidates = [Path(choice)] if choice else _openblas_candidates()
    for lib in candidates:
        if lib.is_file():
            try:
                ctypes.CDLL(str(lib), mode=os.RTLD_GLOBAL)
            except OSError:
                continue
            _state["blas"] = str(lib)
            break
    return _state["blas"]


def blas() -> str:
    """The BLAS MLX's CPU matmuls go to: a library path, 'reference' or 'accelerate'."""
    return _state["blas"]
