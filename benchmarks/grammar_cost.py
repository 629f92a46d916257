"""What holding an answer to a JSON schema costs, on the default model, in one process.

    ROUNDS=3 TOKENS=64 python benchmarks/grammar_cost.py

The scheduler answers one question greedily, TOKENS tokens at most, free and held to a
schema (rounds alternate the order), alone and as a batch of 8; prints decode tok/s per
round and their medians, and the grammar's own time per token (llguidance's mask and its
application, timed around the processor).
"""

import os
import statistics
import time

from mlxkv.backend import setup_blas

setup_blas()  # route MLX to OpenBLAS before anything imports MLX

from mlxkv.engine import grammar as grammar_module  # noqa: E402
from mlxkv.engine.events import Finished  # noqa: E402
from mlxkv.engine.grammar import json_grammar  # noqa: E402
from mlxkv.engine.scheduler import Request, Scheduler  # noqa: E402
from mlxkv.engine.session import GenerationSettings  # noqa: E402
from mlxkv.models.loader import load  # noqa: E402
from mlxkv.models.resolve import resolve  # noqa: E402
from mlxkv.policy import KVPolicy  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", 3))
TOKENS = int(os.environ.get("TOKENS", 64))
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

spent = [0.0, 0]  # seconds in the grammar processor, calls
original_call = grammar_module.GrammarProcessor.__call__


def timed_call(self, history, logits):
    t = time.perf_counter()
    out = original_call(self, history, logits)
    spent[0] += time.perf_counter() - t
    spent[1] += 1
    return out


grammar_module.GrammarProcessor.__call__ = timed_call


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
            spent[:] = [0.0, 0]
            results[held].append(run(held, rows))
            if held:
                per_token = 1000 * spent[0] / max(spent[1], 1)
        print(
            f"rows {rows} round {r}: free {results[False][-1]:.1f} tok/s, "
            f"schema {results[True][-1]:.1f} tok/s, grammar {per_token:.2f} ms/token/row"
        )
    free, held = statistics.median(results[False]), statistics.median(results[True])
    print(f"rows {rows} median: free {free:.1f}, schema {held:.1f} tok/s ({held / free:.2f}x)")
