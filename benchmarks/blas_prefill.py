"""Prefill speed of the default model under each BLAS MLX can use on Linux.

reference = the mlx[cpu] wheel's netlib BLAS (MLXKV_BLAS=reference)
cmeel     = libopenblas.so from the cmeel-openblas wheel (MLXKV_BLAS=cmeel, no apt)
system    = Debian's libopenblas0-pthread (MLXKV_BLAS=system)

Each measurement is a fresh ``mlxkv generate --json`` process, exactly what a user runs;
the three BLAS run interleaved in every round (so a busy machine slows them alike), and
the table gives medians over rounds with the load average seen during the runs.
Usage: python benchmarks/blas_prefill.py [--rounds 5] [--long]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

BLAS = ("reference", "cmeel", "system")
README_PROMPT = "What is the capital of France?"  # the README's first command
LONG_PROMPT = (
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife. "
) * 20


def run(blas: str, prompt: str) -> dict:
    env = {**os.environ, "MLXKV_BLAS": blas}
    cmd = [sys.executable, "-m", "mlxkv", "generate", "--json", "--max-tokens", "8"]
    out = subprocess.run([*cmd, "--prompt", prompt], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{blas}: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--long", action="store_true", help="also a ~280-token prompt")
    args = ap.parse_args()
    prompts = {"README prompt": README_PROMPT}
    if args.long:
        prompts["long prompt"] = LONG_PROMPT
    tps = {(b, p): [] for b in BLAS for p in prompts}
    tokens, loads, libs = {}, [], {}
    for r in range(args.rounds):
        for name, prompt in prompts.items():
            for b in BLAS:
                res = run(b, prompt)
                tps[b, name].append(res["prompt_tps"])
                tokens[name], libs[b] = res["prompt_tokens"], res["blas"]
                loads.append(os.getloadavg()[0])
                print(f"round {r + 1} {name} {b}: {res['prompt_tps']:.1f} tok/s", file=sys.stderr)
    print(
        f"load average (1 min) during the runs: median {statistics.median(loads):.1f}, "
        f"min {min(loads):.1f}, max {max(loads):.1f}; {os.cpu_count()} CPUs\n"
    )
    print(
        "| BLAS | library | "
        + " | ".join(f"{n} ({tokens[n]} tokens) prefill tok/s" for n in prompts)
        + " |"
    )
    print("|---|---|" + "---:|" * len(prompts))
    for b in BLAS:
        cells = " | ".join(
            f"{statistics.median(v):.1f} (min {min(v):.1f}, max {max(v):.1f})"
            for v in (tps[b, n] for n in prompts)
        )
        print(f"| {b} | `{libs[b]}` | {cells} |")


if __name__ == "__main__":
    main()
