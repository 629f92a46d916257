"""Prefill and decode speed of the default model against OpenBLAS's thread count.

Each measurement is a fresh ``mlxkv generate --json`` process, exactly what a user runs:
the README's first prompt for prefill (37 tokens with the chat template) and a 64-token
answer for decode. The variants run interleaved in every round, so a change in the
machine's speed during the run reaches them alike; the table gives medians over rounds.
``--busy N`` keeps N other processes spinning on the CPU meanwhile (a machine that is
doing something else), started ``--settle`` seconds before the first run.

Usage: python benchmarks/blas_threads.py [--rounds 8] [--busy 0] [--variant ENV ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

README_PROMPT = "What is the capital of France?"  # the README's first command
DECODE_PROMPT = "Write a short poem about the sea."
VARIANTS = ("default", "OPENBLAS_NUM_THREADS=1", "OPENBLAS_NUM_THREADS=2")


def run(variant: str, prompt: str, max_tokens: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENBLAS_")}
    if variant != "default":
        env.update(kv.split("=", 1) for kv in variant.split())
    cmd = [sys.executable, "-m", "mlxkv", "generate", "--json", "--temp", "0"]
    cmd += ["--max-tokens", str(max_tokens), "--prompt", prompt]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{variant}: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout)


def _cell(values: list[float], digits: int) -> str:
    mid, low, high = statistics.median(values), min(values), max(values)
    return f"{mid:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--busy", type=int, default=0, help="spinning processes beside the runs")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds to wait with --busy")
    ap.add_argument("--variant", action="append", help="'default' or ENV=VALUE pairs")
    args = ap.parse_args()
    variants = args.variant or list(VARIANTS)
    spin = [sys.executable, "-c", "while True: pass"]
    busy = [subprocess.Popen(spin) for _ in range(args.busy)]
    try:
        if busy:
            time.sleep(args.settle)
        prefill = {v: [] for v in variants}
        decode = {v: [] for v in variants}
        threads, loads = {}, []
        for r in range(args.rounds):
            for v in variants:
                a = run(v, README_PROMPT, 8)
                b = run(v, DECODE_PROMPT, 64)
                prefill[v].append(a["prompt_tps"])
                decode[v].append(b["generation_tps"])
                threads.setdefault(v, set()).update({a["blas_threads"], b["blas_threads"]})
                loads.append(os.getloadavg()[0])
                print(
                    f"round {r + 1} {v}: prefill {a['prompt_tps']:.1f}, "
                    f"decode {b['generation_tps']:.2f} tok/s",
                    file=sys.stderr,
                )
    finally:
        for p in busy:
            p.kill()
    print(
        f"{args.busy} busy processes; load average (1 min) during the runs: median "
        f"{statistics.median(loads):.1f} ({min(loads):.1f}-{max(loads):.1f}); "
        f"{len(os.sched_getaffinity(0))} usable cores; {args.rounds} rounds\n"
    )
    print("| variant | BLAS threads | README prompt prefill tok/s | runs >= 100 | decode tok/s |")
    print("|---|---|---:|---:|---:|")
    for v in variants:
        hits = sum(t >= 100 for t in prefill[v])
        used = ", ".join(str(t) for t in sorted(threads[v]))
        print(
            f"| `{v}` | {used} | {_cell(prefill[v], 1)} | {hits}/{len(prefill[v])} "
            f"| {_cell(decode[v], 2)} |"
        )


if __name__ == "__main__":
    main()
