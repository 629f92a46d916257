"""A long mixed workload against one ``mlxkv serve``: does its memory come back?

    python benchmarks/soak_bench.py [--requests 600] [--concurrency 4] [--max-seconds 1800]
        [--every 10] [--corpus ../shared/data/austen.txt] [--workdir DIR] [--json OUT.json]
        [-- SERVE ARGS...]

See ``mlxkv/bench/soak.py`` for the workload and what is measured. Prints a JSON line per
sample while it runs, then the summary.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def main() -> None:
    from mlxkv.bench.soak import run, summary

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-seconds", type=float, default=1800)
    p.add_argument("--every", type=float, default=10, help="seconds between samples")
    here = Path(__file__).resolve().parents[1]
    p.add_argument("--corpus", type=Path, default=here.parent / "shared" / "data" / "austen.txt")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mlxkv-soak")
    p.add_argument("--json", type=Path, default=None, help="write the samples and summary here")
    p.add_argument("serve_args", nargs="*", help="more mlxkv serve options (after --)")
    args = p.parse_args()
    result = run(
        args.workdir,
        args.corpus,
        requests=args.requests,
        concurrency=args.concurrency,
        max_seconds=args.max_seconds,
        every=args.every,
        serve_args=args.serve_args,
    )
    result["summary"] = summary(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    for e in result["errors"][:10]:
        print(e)
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
