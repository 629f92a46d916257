"""How often a Ctrl+C leaves ``mlx.launch`` hung after its ranks have stopped, with its
standard input at its end (``< /dev/null``) or an open pipe (a terminal's case).

    python benchmarks/launcher_ctrl_c.py --stops 150 --stdin devnull
    python benchmarks/launcher_ctrl_c.py --stops 150 --stdin pipe

Each stop launches 2 ranks that sleep, sends SIGINT to the whole group (what a terminal's
Ctrl+C does), and counts the launcher as hung when it is still running ``--wait`` seconds
later; a second SIGINT then ends it. The ranks run no MLX: the hang is the launcher's own
(see docs/distributed.md, "Stopping").
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mlxkv.bench.serve import free_ports

BIN = Path(sys.executable).parent
RANK = "import time; print('up', flush=True); time.sleep(600)"


def one_stop(stdin: str, wait: float) -> tuple[bool, bool]:
    """(hung, ended by a second SIGINT) for one launch and Ctrl+C."""
    cmd = [str(BIN / "mlx.launch"), "-n", "2", "--starting-port", str(free_ports(2)), "--"]
    cmd += [sys.executable, "-c", RANK]
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE if stdin == "pipe" else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    for _ in range(2):  # both ranks are up
        proc.stdout.readline()
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(wait)
        hung, second = False, False
    except subprocess.TimeoutExpired:
        hung = True
        os.kill(proc.pid, signal.SIGINT)
        try:
            proc.wait(wait)
            second = True
        except subprocess.TimeoutExpired:
            second = False
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group
    except ProcessLookupError:
        pass
    proc.wait()
    if proc.stdin:
        proc.stdin.close()
    proc.stdout.close()
    return hung, second


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stops", type=int, default=100)
    p.add_argument("--stdin", choices=["devnull", "pipe"], default="devnull")
    p.add_argument("--wait", type=float, default=10.0, help="seconds before a launcher is hung")
    args = p.parse_args()
    load = f"{os.getloadavg()[0]:.2f}"
    start = time.monotonic()
    hung = ended = 0
    for _ in range(args.stops):
        h, s = one_stop(args.stdin, args.wait)
        hung += h
        ended += s
    took = time.monotonic() - start
    print(
        f"stdin {args.stdin}: {hung} of {args.stops} Ctrl+C stops left mlx.launch hung; a second "
        f"SIGINT ended {ended} of them ({took:.0f} s, load {load} at the start)"
    )


if __name__ == "__main__":
    main()
