"""What scoring a prompt costs (``echo`` with ``logprobs``: every position's logits), on the
default model, in one process.

    python benchmarks/prompt_scoring.py TEXT_FILE [--tokens 2048] [--rounds 3] [--top 1]

The scheduler prefills the first --tokens tokens of TEXT_FILE plainly and scored (rounds
alternate the order), each time a fresh prompt cache, one answer token; prints prefill
tok/s per round and the medians.
"""

import argparse
import statistics

from mlxkv.backend import setup_blas

parser = argparse.ArgumentParser(description="prefill speed, plain and scored")
parser.add_argument("text", help="a text file (the prompt is its first tokens)")
parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens")
parser.add_argument("--rounds", type=int, default=3, help="rounds (order alternates)")
parser.add_argument("--top", type=int, default=1, help="alternatives per scored token")
args = parser.parse_args()

setup_blas()  # route MLX to OpenBLAS before anything imports MLX

from mlxkv.bench.corpus import token_stream  # noqa: E402
from mlxkv.engine.events import Finished  # noqa: E402
from mlxkv.engine.scheduler import Request, Scheduler  # noqa: E402
from mlxkv.engine.session import GenerationSettings  # noqa: E402
from mlxkv.models.loader import load  # noqa: E402
from mlxkv.models.resolve import resolve  # noqa: E402
from mlxkv.policy import KVPolicy  # noqa: E402

loaded = load(resolve(None).path)
with open(args.text, encoding="utf-8") as f:
    ids, _ = token_stream(loaded.tokenizer, f.read(), args.tokens)
ids = ids[: args.tokens]


def run(scored: bool) -> float:
    """Prefill tok/s of the prompt (no prefix cache, nothing shared)."""
    sched = Scheduler(loaded, KVPolicy(), max_batch=1, share_prefix=False)
    top = args.top if scored else None
    handle = sched.submit(Request(ids, GenerationSettings(max_tokens=1), prompt_logprobs=top))
    while sched.step():
        pass
    (done,) = [e for e in handle.events() if isinstance(e, Finished)]
    return done.stats.prompt_tps


results = {False: [], True: []}
for r in range(args.rounds):
    for scored in (False, True) if r % 2 == 0 else (True, False):
        results[scored].append(run(scored))
    print(f"round {r}: plain {results[False][-1]:.1f} tok/s, scored {results[True][-1]:.1f} tok/s")
plain, scored = statistics.median(results[False]), statistics.median(results[True])
print(f"median: plain {plain:.1f}, scored {scored:.1f} tok/s ({scored / plain:.2f}x)")
