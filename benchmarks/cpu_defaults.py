"""Prefill and decode speed of the default model under mlxkv's CPU defaults vs stock.

stock   = ``--dtype native``: packed weights (Q4_1/Q8_0 -> MLX quantized) in the checkpoint's
          dtype (the GPU rule, docs/gpu.md) + the mlx-cpu wheel's reference BLAS (what
          mlx-lm does out of the box on Linux with an MLX checkpoint)
mlxkv   = float32 weights + Debian OpenBLAS (mlxkv's default when OpenBLAS is installed)

Runs ``mlxkv generate --json`` in fresh processes, interleaved, and prints medians.
Usage: python benchmarks/cpu_defaults.py [--rounds 3] [--text FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CONFIGS = {
    "stock (native weights, reference BLAS)": ("native", "reference"),
    "float32, reference BLAS": ("auto", "reference"),
    "native weights, OpenBLAS": ("native", ""),
    "mlxkv default (float32, OpenBLAS)": ("auto", ""),
}
PROMPT = (
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife. "
) * 12


def run(dtype: str, blas: str, max_tokens: int, prompt: str) -> dict:
    env = {**os.environ, "MLXKV_BLAS": blas}
    cmd = [sys.executable, "-m", "mlxkv", "generate", "--raw", "--json", "--force"]
    cmd += ["--dtype", dtype, "--max-tokens", str(max_tokens), "--prompt", prompt]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--text", help="a UTF-8 file whose start is the prompt (default: built in)")
    args = ap.parse_args()
    prompt = open(args.text, encoding="utf-8").read()[:1500] if args.text else PROMPT
    results = {name: [] for name in CONFIGS}
    for _ in range(args.rounds):
        for name, (dtype, blas) in CONFIGS.items():
            results[name].append(run(dtype, blas, args.max_tokens, prompt))
    print("| configuration | prompt tokens | prefill tok/s | decode tok/s |")
    print("|---|---:|---:|---:|")
    for name, rs in results.items():
        pre = statistics.median(r["prompt_tps"] for r in rs)
        dec = statistics.median(r["generation_tps"] for r in rs)
        print(f"| {name} | {rs[0]['prompt_tokens']} | {pre:.1f} | {dec:.1f} |")


if __name__ == "__main__":
    main()
