"""Prefill speed of the default model under each BLAS source MLX can use on Linux.

A variant is a label and the environment it runs with, e.g. ``"ngsolve MLXKV_BLAS=ngsolve"``
or ``"mkl MLXKV_BLAS=/path/libmkl_rt.so.3 MKL_THREADING_LAYER=SEQUENTIAL"``. Defaults:

reference = the mlx[cpu] wheel's netlib BLAS (MLXKV_BLAS=reference)
ngsolve   = the ngsolve-openblas wheel, Fortran runtime from the mlx-cpu wheel (the default)
cmeel     = the cmeel-openblas wheel as installed (needs the system's libgfortran.so.5)

Each measurement is a fresh ``mlxkv generate --json`` process, exactly what a user runs;
the variants run interleaved in every round (so a busy machine slows them alike), and the
table gives medians over rounds with the load average seen during the runs. A variant that
cannot load is reported with its one-line error. ``--fresh-libs TOOL`` runs every process
under ../shared/tools/fresh-libs (Debian's OpenBLAS and Fortran runtime hidden).

Usage: python benchmarks/blas_prefill.py [--rounds 5] [--fresh-libs TOOL] [--variant ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

README_PROMPT = "What is the capital of France?"  # the README's first command
VARIANTS = (
    "reference MLXKV_BLAS=reference",
    "ngsolve MLXKV_BLAS=ngsolve",
    "cmeel MLXKV_BLAS=cmeel",
)


def run(variant: str, wrap: list[str]) -> dict | str:
    """One ``mlxkv generate --json`` run: its result, or its last stderr line if it failed."""
    _, *pairs = variant.split()
    env = {k: v for k, v in os.environ.items() if k != "MLXKV_BLAS"}
    env.update(kv.split("=", 1) for kv in pairs)
    cmd = [*wrap, sys.executable, "-m", "mlxkv", "generate", "--json", "--temp", "0"]
    out = subprocess.run([*cmd, "--prompt", README_PROMPT], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return (out.stderr.strip().splitlines() or ["no output"])[-1]
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fresh-libs", help="path of shared/tools/fresh-libs to run under")
    ap.add_argument("--variant", action="append", help="'LABEL [ENV=VALUE ...]'")
    args = ap.parse_args()
    variants = args.variant or list(VARIANTS)
    wrap = ["bash", args.fresh_libs] if args.fresh_libs else []
    tps = {v: [] for v in variants}
    info, loads = {}, []
    for r in range(args.rounds):
        for v in variants:
            res = run(v, wrap)
            loads.append(os.getloadavg()[0])
            if isinstance(res, str):
                info[v] = res
                print(f"round {r + 1} {v}: failed: {res}", file=sys.stderr)
                continue
            tps[v].append(res["prompt_tps"])
            info.setdefault(v, (res["blas"], res["blas_threads"], res["prompt_tokens"]))
            print(f"round {r + 1} {v}: {res['prompt_tps']:.1f} tok/s", file=sys.stderr)
    print(
        f"load average (1 min) during the runs: median {statistics.median(loads):.1f}, "
        f"min {min(loads):.1f}, max {max(loads):.1f}; {os.cpu_count()} CPUs"
        + ("; under fresh-libs" if wrap else "")
        + "\n"
    )
    print("| variant | BLAS in use (`blas`) | threads | README prompt prefill tok/s |")
    print("|---|---|---:|---:|")
    for v in variants:
        label = v.split()[0]
        if not tps[v]:
            print(f"| {label} | does not load: {info[v]} | | |")
            continue
        blas, threads, _ = info[v]
        cell = f"{statistics.median(tps[v]):.1f} ({min(tps[v]):.1f}-{max(tps[v]):.1f})"
        print(f"| {label} | `{blas}` | {threads} | {cell} |")


if __name__ == "__main__":
    main()
