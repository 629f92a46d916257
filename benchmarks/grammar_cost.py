"""What holding an answer to a JSON schema costs, on the default model, in one process.

    python benchmarks/grammar_cost.py [--rounds 3] [--tokens 64]

The scheduler answers one question greedily, --tokens tokens at most, free and held to a
schema (rounds alternate the order), alone and as a batch of 8; prints decode tok/s per
round and their medians. (A held row also waits for each token before its next mask: the
grammar needs it, so its time cannot be told apart from the model's here.)
"""

import argparse
import statistics

from mlxkv.backend import setup_blas

parser = argparse.ArgumentParser(description="decode speed free and held to a JSON schema")
parser.add_argument("--rounds", type=int, default=3, help="rounds (order alternates)")
parser.add_argument("--tokens", type=int, default=64, help="most tokens per answer")
args = parser.parse_args()

setup_blas()  # route MLX to OpenBLAS before anything imports MLX

from mlxkv.engine.events import Finished  # noqa: E402
from mlxkv.engine.grammar import json_grammar  # noqa: E402
from mlxkv.engine.scheduler import Request, Scheduler  # noqa: E402
from mlxkv.engine.session import GenerationSettings  # noqa: E402
from mlxkv.models.loader import load  # noqa: E402
from mlxkv.models.resolve import resolve  # noqa: E402
from mlxkv.policy import KVPolicy  # noqa: E402

ROUNDS, TOKENS = args.rounds, args.tokens
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40}},
    },
    "required": ["city", "country", "population", "landmarks"],
}

loaded = load(resolve(None).path)
text = loaded.tokenizer.apply_chat_template(
    [{"role": "user", "content": "Describe Paris as JSON: city, country, population."}],
    tokenize=False,
    add_generation_prompt=True,
)
ids = Scheduler(loaded).encode(text)
grammar = json_grammar(SCHEMA)


def run(held: bool, rows: int) -> float:
    """Decode tok/s of ``rows`` answers (free or held), prefill excluded."""
    sched = Scheduler(loaded, KVPolicy(), max_batch=rows)
    settings = GenerationSettings(max_tokens=TOKENS, grammar=grammar if held else None)
    handles = [sched.submit(Request(ids, settings)) for _ in range(rows)]
    while sched.step():
        pass
    done = [[e for e in h.events() if isinstance(e, Finished)][0] for h in handles]
    tokens = sum(d.stats.generation_tokens for d in done)
    return tokens / sum(d.stats.generation_tokens / d.stats.generation_tps for d in done) * rows


for rows in (1, 8):
    results = {False: [], True: []}
    for r in range(ROUNDS):
        for held in (False, True) if r % 2 == 0 else (True, False):
            results[held].append(run(held, rows))
        print(
            f"rows {rows} round {r}: free {results[False][-1]:.1f} tok/s, "
            f"schema {results[True][-1]:.1f} tok/s"
        )
    free, held = statistics.median(results[False]), statistics.median(results[True])
    print(f"rows {rows} median: free {free:.1f}, schema {held:.1f} tok/s ({held / free:.2f}x)")
