"""Before/after speed of the engine, interleaved: two checkouts of mlxkv, the same runs.

    python benchmarks/engine_ab.py BEFORE_DIR AFTER_DIR [--rounds 3] [--max-tokens 96] [--lines 8]

BEFORE_DIR / AFTER_DIR are checkouts (e.g. ``git worktree add /tmp/before a392f52``).
Prints a markdown table of medians and the median per-round ratio after / before for
single-sequence prefill and decode, a batch of ``--lines`` lines and the same lines one at a time,
under the full, sink + window (one window the answer outruns) and 4-bit policies, or those
named with ``--policy`` (see mlxkv/bench/ab.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mlxkv.bench.ab import POLICIES, measure, table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--lines", type=int, default=8, help="batch lines (at most 8)")
    ap.add_argument("--threads", default="1", help="OPENBLAS_NUM_THREADS for every run")
    ap.add_argument("--json", type=Path, help="also write the raw figures here")
    ap.add_argument(
        "--policy",
        action="append",
        choices=list(POLICIES),
        help="measure only this policy (repeatable; default: all)",
    )
    args = ap.parse_args()
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    env = {"OPENBLAS_NUM_THREADS": args.threads}
    res = measure(sides, args.rounds, args.max_tokens, args.lines, env, args.policy)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    print(table(res, "before", "after"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
