"""Bytes of a cache in memory and in its file, per policy and prompt length, on a model.

    python benchmarks/cache_file_sizes.py [--model PATH] [--tokens 39,700,5000]
        [--text ../shared/data/austen.txt]

Each row prefills the first N tokens of the text into fresh caches of the policy, saves
them as the prefix cache's disk tier and ``--prompt-cache`` do (``mlxkv.caches.save_caches``)
and reads them back with every check (``load_checked`` against reference caches). Prints
a Markdown table: memory bytes, file bytes, and the seconds to write and to read back.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from mlxkv.backend import setup_blas

setup_blas()

POLICIES = [
    {},
    {"bits": 4},
    {"window": 4096},
    {"window": 4096, "sinks": 4},
    {"window": 4096, "sinks": 4, "bits": 4},
    {"window": 256, "sinks": 4},
]


def main() -> None:
    import mlx.core as mx

    from mlxkv.caches import make_caches, save_caches
    from mlxkv.caches.persist import load_checked, reference_caches
    from mlxkv.models.loader import load
    from mlxkv.models.resolve import resolve
    from mlxkv.policy import KVPolicy

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model path or alias (the default model)")
    p.add_argument("--tokens", default="39,700,5000")
    p.add_argument("--text", default=str(Path(__file__).parents[2] / "shared/data/austen.txt"))
    args = p.parse_args()
    loaded = load(resolve(args.model).path)
    ids = loaded.tokenizer.encode(Path(args.text).read_text(encoding="utf-8")[:200_000])
    print("| policy | tokens | memory bytes | file bytes | file / memory | write s | read s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "c.safetensors"
        for spec in POLICIES:
            policy = KVPolicy(**spec)
            reference, _ = reference_caches(loaded.model, policy)
            for n in map(int, args.tokens.split(",")):
                caches = make_caches(loaded.model, policy)
                for a in range(0, n, 512):
                    mx.eval(loaded.model(mx.array([ids[a : min(n, a + 512)]]), cache=caches))
                mx.eval([c.state for c in caches])
                memory = sum(c.nbytes for c in caches)
                meta = {"policy": policy.to_dict()}
                t0 = time.perf_counter()
                save_caches(path, caches, meta)
                t1 = time.perf_counter()
                back, _, _ = load_checked(path, meta, reference)
                mx.eval([c.state for c in back])
                t2 = time.perf_counter()
                assert sum(c.nbytes for c in back) == memory
                size = path.stat().st_size
                print(
                    f"| {policy.describe()} | {n} | {memory:,} | {size:,} | "
                    f"{size / memory:.2f} | {t1 - t0:.3f} | {t2 - t1:.3f} |"
                )


if __name__ == "__main__":
    main()
