"""What a small prefill step costs: prompt tok/s with ``--prefill-step 64`` (the chat's
default, so Esc / Ctrl+C stop a prefill within 64 tokens) against 512 (generate's).

    python benchmarks/prefill_step.py [--tokens 1024] [--repeats 3]

Both run in one process, interleaved, on the default model with a full cache; each run
prefills the same prompt into a fresh cache and generates one token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from mlxkv.backend import setup_blas

setup_blas()  # route MLX to OpenBLAS before anything imports MLX


def main(argv=None) -> int:
    from mlxkv.engine.events import Finished
    from mlxkv.engine.loading import open_model
    from mlxkv.engine.session import GenerationSettings, Session

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", default="64,512")
    args = p.parse_args(argv)
    loaded = open_model(None)
    gen = Session(loaded)
    words = "The river runs past the old mill and the town. " * (args.tokens // 10 + 1)
    ids = loaded.tokenizer.encode(words)[: args.tokens]
    prompt = loaded.tokenizer.decode(ids)
    steps = [int(s) for s in args.steps.split(",")]
    tps: dict[int, list[float]] = {s: [] for s in steps}
    for _ in range(args.repeats):
        for step in steps:
            gen.reset()
            settings = GenerationSettings(max_tokens=1, prefill_step=step)
            for ev in gen.run(prompt, settings):
                if isinstance(ev, Finished):
                    tps[step].append(ev.stats.prompt_tps)
    out = {
        "prompt_tokens": args.tokens,
        "prompt_tps": tps,
        "median": {s: statistics.median(v) for s, v in tps.items()},
    }
    base = out["median"][max(steps)]
    out["cost_percent"] = {s: 100 * (base - m) / base for s, m in out["median"].items()}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
