"""What a server gives back when another program takes the machine's memory (Linux: reads
/proc). For each ``--memory-floor`` named (``0``: none, the server keeps what it holds), a
fresh ``mlxkv serve`` on the default model keeps ``--conversations`` finished conversations
(passages of the corpus) as prefixes; then a second process writes enough memory to leave the
machine ``--short`` bytes under a floor set ``--margin`` bytes below what it had free. The
table gives the server's resident memory (VmRSS) before, and 2 and 10 seconds after that
process took its memory; the prefixes left in memory and on disk; and the time a repeat of
the first conversation then took to its first token, beside the same repeat before.

    python benchmarks/floor_bench.py [--floors 0,near] [--conversations 8] [--tokens 1500]
        [--margin 3GiB] [--short 512MiB]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "austen.txt"
HOG = """
import mmap, sys
flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE  # every page resident
block = mmap.mmap(-1, int(sys.argv[1]), flags=flags)
print("held", flush=True)
sys.stdin.read()
"""
GiB, MiB = 2**30, 2**20


def free_now() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no MemAvailable in /proc/meminfo: this benchmark reads Linux's memory")


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def size(text: str) -> int:
    units = {"": 1, "MIB": MiB, "GIB": GiB, "MB": 10**6, "GB": 10**9}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([A-Za-z]*)", text.strip())
    if not m or m.group(2).upper() not in units:
        raise argparse.ArgumentTypeError(f"a size like 512MiB or 3GiB, got {text!r}")
    return int(float(m.group(1)) * units[m.group(2).upper()])


class Server:
    def __init__(self, folder: Path, floor: str):
        self.log = open(folder / "server.log", "w+")
        flags = ["--prefix-cache-dir", str(folder / "prefixes"), "--memory-floor", floor]
        for flag in ("--conversation-dir", "--responses-dir", "--files-dir"):
            flags += [flag, "none"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxkv", "serve", "--port", "0", "--no-access-log", *flags],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 300
        while not (found := re.search(r"on (http://127\.0\.0\.1:\d+)/v1", self.text())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"mlxkv serve did not start:\n{self.text()}")
            time.sleep(0.2)
        self.http = httpx.Client(base_url=found.group(1), timeout=600)

    def text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def first_token(self, passage: str) -> float:
        """Seconds to the first streamed token of a question on ``passage``."""
        body = {
            "messages": [{"role": "user", "content": f"{passage}\n\nWho is this about?"}],
            "max_tokens": 2,
            "temperature": 0,
            "stream": True,
        }
        start, first = time.perf_counter(), None
        with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():  # read to the end: a closed stream is cancelled
                if first is None and '"content":"' in line.replace(" ", ""):
                    first = time.perf_counter() - start
        if first is None:
            raise SystemExit(f"no token came:\n{self.text()}")
        return first

    def status(self) -> dict:
        return self.http.get("/v1/status").json()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def one(floor: str, passages: list[str], margin: int, short: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        free = free_now()
        line = floor if floor != "near" else str(free - margin)
        server = Server(Path(tmp), line)
        try:
            cold = server.first_token(passages[0])
            for p in passages[1:]:
                server.first_token(p)
            warm = server.first_token(passages[0])  # from memory
            before = rss(server.proc.pid)
            # the machine left `short` under a floor `margin` below what it had free
            take = margin + short - (free - free_now())
            hog = subprocess.Popen(
                [sys.executable, "-c", HOG, str(take)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert hog.stdout.readline().strip() == "held"
            taken = time.monotonic()
            time.sleep(2)
            at2 = rss(server.proc.pid)
            time.sleep(max(0.0, 10 - (time.monotonic() - taken)))
            at10 = rss(server.proc.pid)
            s = server.status()
            hog.communicate("", timeout=60)
            time.sleep(2)
            after = server.first_token(passages[0])  # from disk, or from memory
            cache = s["prefix_cache"]
            for said in server.text().splitlines():  # what the server said of its floor
                if "floor" in said:
                    print(said, flush=True)
            return {
                "floor": "none" if floor == "0" else f"{int(line) / GiB:.2f} GiB",
                "taken": take,
                "before": before,
                "at2": at2,
                "at10": at10,
                "memory": (cache["entries"], cache["bytes"]),
                "disk": cache["disk"]["entries"],
                "cold": cold,
                "warm": warm,
                "after": after,
            }
        finally:
            server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--floors",
        default="0,near",
        help="--memory-floor values; near: --margin under what the machine has free",
    )
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1500, help="about this many prompt tokens each")
    p.add_argument("--margin", type=size, default=3 * GiB, help="floor below free memory")
    p.add_argument("--short", type=size, default=512 * MiB, help="how far under the floor")
    args = p.parse_args()
    words = CORPUS.read_text().split()
    n = int(args.tokens * 0.7)  # about 1.4 tokens a word in this corpus
    passages = [" ".join(words[i * n : (i + 1) * n]) for i in range(args.conversations)]
    print(f"load average {os.getloadavg()[0]:.2f}; {free_now() / GiB:.1f} GiB free", flush=True)
    rows = [one(f, passages, args.margin, args.short) for f in args.floors.split(",")]
    print(
        "\n| floor | taken by the other process | server RSS before | after 2 s | after 10 s "
        "| prefixes in memory | on disk | first token: cold / from memory / after |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        entries, held = r["memory"]
        print(
            f"| {r['floor']} | {r['taken'] / GiB:.2f} GiB | {r['before'] / MiB:,.0f} MiB "
            f"| {r['at2'] / MiB:,.0f} MiB | {r['at10'] / MiB:,.0f} MiB "
            f"| {entries} ({held / MiB:,.0f} MiB) | {r['disk']} "
            f"| {r['cold']:.2f} / {r['warm']:.2f} / {r['after']:.2f} s |"
        )


if __name__ == "__main__":
    main()
