"""``mlxkv serve`` split over local ``mlx.launch`` ranks against one process: the same greedy
requests to each (the texts compared), decode speed, and the CPU time every process spends
while the server idles.

    python benchmarks/split_serve.py --ranks 3 --requests 4 --max-tokens 32 --idle 10

On one machine the ranks share its cores, so the split server is slower here than one
process; the numbers show what the per-step exchange between ranks and an idle server cost,
not what several Macs would do. Linux only (it reads /proc).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from mlxkv.bench.serve import free_ports

BIN = Path(sys.executable).parent
TICK = os.sysconf("SC_CLK_TCK")


def start(cmd: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    out = open(log, "w")
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.PIPE, env=env,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", log.read_text())
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit(f"the server did not start:\n{log.read_text()}")


def group(pgid: int) -> dict[int, tuple[str, float]]:
    """pid -> (what it is, CPU seconds so far) for every process of group ``pgid``."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            env = Path(f"/proc/{pid}/environ").read_bytes()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) != pgid:
            continue
        rank = re.search(rb"MLX_RANK=(\d+)", env)
        what = "mlx.launch" if b"mlx.launch" in cmd else "server"
        what = f"rank {rank.group(1).decode()}" if rank else what
        out[int(pid)] = (what, (int(fields[11]) + int(fields[12])) / TICK)
    return out


def ask(url: str, text: str, max_tokens: int) -> tuple[str, float]:
    body = {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=1200).json()
    return r["choices"][0]["message"]["content"], r["usage"]["completion_tokens"]


def run(name: str, cmd: list[str], work: Path, args) -> dict:
    proc, url = start(cmd, work / f"{name}.log")
    try:
        texts, tokens, t0 = [], 0, time.perf_counter()
        for i in range(args.requests):
            text, n = ask(url, f"Write a short story about the number {i}.", args.max_tokens)
            texts.append(text)
            tokens += n
        elapsed = time.perf_counter() - t0
        before = group(proc.pid)
        time.sleep(args.idle)
        after = group(proc.pid)
        idle = {
            after[p][0]: round((after[p][1] - before[p][1]) / args.idle, 3)
            for p in after
            if p in before
        }
        return {
            "server": name,
            "texts": texts,
            "tokens": tokens,
            "tok_per_s": round(tokens / elapsed, 2),
            "idle_cpu_per_s": dict(sorted(idle.items())),
            "load": os.getloadavg()[0],
        }
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the registry default")
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--shard", default="auto", help="how the ranks split the model (serve --shard)")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--idle", type=float, default=10.0, help="seconds of idle CPU measured")
    p.add_argument("--workdir", default="/tmp/split_serve")
    args = p.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    serve = [str(BIN / "mlxkv"), "serve", "--port", "0", "--prefix-cache-bytes", "0"]
    if args.model:
        serve += ["--model", args.model]
    launch = [str(BIN / "mlx.launch"), "-n", str(args.ranks)]
    launch += ["--starting-port", str(free_ports(args.ranks)), "--"]
    split = [*launch, *serve, "--shard", args.shard]
    rows = [
        run("one process", serve, work, args),
        run(f"{args.ranks} ranks ({args.shard})", split, work, args),
    ]
    same = rows[0]["texts"] == rows[1]["texts"]
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if k != "texts"}))
    print(json.dumps({"same_texts": same}))


if __name__ == "__main__":
    main()
