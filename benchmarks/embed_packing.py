"""How embedding inputs should share model calls: the scheduler's rule against the
alternatives, on the default model, in-process (no HTTP).

    python benchmarks/embed_packing.py [TEXT] [--pairs 40] [--reps 2]

The inputs of ``embed_bench.py`` (each of ``--pairs`` paragraphs of TEXT split into its
first sentence and the rest): all of them (lengths mixed), then the first sentences alone
(short), each submitted as ``mlxkv serve`` submits one request's inputs (16 in flight, the
default ``--max-batch``, the next 16 when they are done). Per rule: seconds (the mean of
``--reps`` runs, the rules taken in turn, the order reversed each run), model calls, the
tokens they fed (padding included), and the largest difference of a vector from its
input's own in a call of its own.
"""

from mlxkv.backend import setup_blas

setup_blas()

import argparse  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from embed_bench import pairs  # noqa: E402

from mlxkv.bench.corpus import read_text  # noqa: E402
from mlxkv.engine.events import Embedding  # noqa: E402
from mlxkv.engine.request import GenerationSettings  # noqa: E402
from mlxkv.engine.scheduler import Request, Scheduler  # noqa: E402
from mlxkv.models.loader import load  # noqa: E402
from mlxkv.models.resolve import resolve  # noqa: E402

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "austen.txt"
WAVE = 16


class Counted(Scheduler):
    """A scheduler that counts its embedding calls and the tokens they feed, padding
    included."""

    calls = fed = 0

    def _embed_rows(self, batch):
        self.calls += 1
        self.fed += len(batch) * max(j.total for j in batch)
        return super()._embed_rows(batch)


class Alone(Counted):
    def _pack(self, first, padding=0.0):
        return [first]


class ArrivalOrder(Counted):
    """Waiting inputs in the order they came, rows x longest within the prefill step."""

    def _pack(self, first, padding=0.0):
        batch = [first]
        for job in self._waiting:
            rows = [*batch, job]
            if job is first or not self._in_one_call(job):
                continue
            if len(rows) * max(j.total for j in rows) > job.req.settings.prefill_step:
                continue
            batch = rows
        return batch


def nearest(bound: float):
    class Nearest(Counted):
        def _pack(self, first, padding=bound):
            return super()._pack(first, padding)

    return Nearest


RULES = {
    "a call per input": Alone,
    "arrival order, any padding": ArrivalOrder,
    "nearest length, any padding": nearest(1.0),
    "nearest length, padding <= 1/2": nearest(0.5),
    "nearest length, padding <= 1/4 (the scheduler's)": Counted,
}


def embed(loaded, rule, inputs: list[list[int]]) -> tuple[float, tuple[int, int], list]:
    sched = rule(loaded, max_batch=WAVE)
    settings = GenerationSettings(max_tokens=1)
    vectors, t = [], time.perf_counter()
    for start in range(0, len(inputs), WAVE):
        handles = [
            sched.submit(Request(ids, settings, embed="last"))
            for ids in inputs[start : start + WAVE]
        ]
        while sched.step():
            pass
        for h in handles:
            vectors.append(next(e.vector for e in h.events() if isinstance(e, Embedding)))
    return time.perf_counter() - t, (sched.calls, sched.fed), vectors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("text", type=Path, nargs="?", default=CORPUS)
    p.add_argument("--pairs", type=int, default=40)
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args()
    loaded = load(resolve("smollm2-135m").path)
    qa = pairs(read_text(args.text), args.pairs)
    tok = loaded.tokenizer

    def ids(text):
        return tok.encode(text, add_special_tokens=True)

    workloads = {
        "all inputs": [ids(q) for q, _ in qa] + [ids(d) for _, d in qa],
        "first sentences": [ids(q) for q, _ in qa],
    }
    for name, inputs in workloads.items():
        embed(loaded, Alone, inputs[:WAVE])  # warm up
        seconds = {r: [] for r in RULES}
        calls, vectors = {}, {}
        for rep in range(args.reps):
            order = list(RULES) if rep % 2 == 0 else list(reversed(RULES))
            for r in order:
                s, calls[r], vectors[r] = embed(loaded, RULES[r], inputs)
                seconds[r].append(s)
        tokens = sum(len(x) for x in inputs)
        print(f"\n{name}: {len(inputs)} inputs, {tokens} tokens")
        print("| rule | seconds | tokens/s | model calls | tokens fed | largest difference |")
        print("|---|---|---|---|---|---|")
        alone = vectors["a call per input"]
        for r in RULES:
            mean = sum(seconds[r]) / len(seconds[r])
            diff = max(
                abs(a - b)
                for va, vb in zip(vectors[r], alone, strict=True)
                for a, b in zip(va, vb, strict=True)
            )
            print(
                f"| {r} | {mean:.2f} | {tokens / mean:.0f} | {calls[r]} | {diff:.1e} |", flush=True
            )


if __name__ == "__main__":
    main()
