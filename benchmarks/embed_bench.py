"""What ``/v1/embeddings`` gives on a chat model, and how fast: a retrieval check and a
throughput run against ``mlxkv serve``, once per pooling (``--embedding-pooling``).

    python benchmarks/embed_bench.py TEXT [--model M] [--pairs 40] [--json OUT.json]

From any UTF-8 text: ``--pairs`` paragraphs spread over it (three sentences or more), each
split into its first sentence (the query) and the rest (the document). Each query's
nearest document by cosine similarity should be its own: top-1 accuracy and mean
reciprocal rank over all the documents, beside two baselines that need no model
(chance, 1/pairs; and shared words, the document whose word set overlaps the query's
most by Jaccard index). Throughput: every query and document in one request through the
official ``openai`` client, input tokens per second of wall time (after one short request
that warms the server up); then the queries alone (one sentence each), the short inputs
that share model calls most.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import time
from pathlib import Path

from mlxkv.backend import setup_blas

setup_blas()  # the server runs MLX in its own process; this keeps the rule in one place

SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'])")


def pairs(text: str, n: int) -> list[tuple[str, str]]:
    """(first sentence, the rest) of ``n`` paragraphs spread evenly over ``text``."""
    found = []
    for para in re.split(r"\n\s*\n", text):
        para = " ".join(para.split())
        parts = SENTENCE.split(para)
        if len(parts) >= 3 and 300 <= len(para) <= 1500:
            found.append((parts[0], " ".join(parts[1:])))
    if len(found) < n:
        raise SystemExit(f"the text has {len(found)} paragraphs of three sentences; ask fewer")
    step = len(found) / n
    return [found[int(i * step)] for i in range(n)]


def scores(query_vectors, doc_vectors) -> tuple[float, float]:
    """Top-1 accuracy and mean reciprocal rank of each query's own document."""
    top1, rr = 0, 0.0
    for i, q in enumerate(query_vectors):
        sims = [sum(a * b for a, b in zip(q, d, strict=True)) for d in doc_vectors]
        rank = 1 + sum(s > sims[i] for s in sims)
        top1 += rank == 1
        rr += 1 / rank
    n = len(query_vectors)
    return top1 / n, rr / n


def words(t: str) -> set[str]:
    return set(re.findall(r"[a-z]+", t.lower()))


def lexical(qa: list[tuple[str, str]]) -> tuple[float, float]:
    def jaccard(a, b):
        return len(a & b) / max(1, len(a | b))

    q = [words(x) for x, _ in qa]
    d = [words(y) for _, y in qa]
    top1, rr = 0, 0.0
    for i in range(len(qa)):
        sims = [jaccard(q[i], x) for x in d]
        rank = 1 + sum(s > sims[i] for s in sims)
        top1 += rank == 1
        rr += 1 / rank
    return top1 / len(qa), rr / len(qa)


def run(model: str | None, pooling: str, qa: list[tuple[str, str]], workdir: Path) -> dict:
    from openai import OpenAI

    from mlxkv.bench.serve import ServerProcess, free_port

    port = free_port()
    cmd = [sys.executable, "-m", "mlxkv", "serve", *([model] if model else []), "--port"]
    cmd += [str(port), "--no-access-log", "--embedding-pooling", pooling]
    cmd += ["--prefix-cache-bytes", "0"]
    server = ServerProcess("mlxkv serve", cmd, port, workdir / f"serve-{pooling}.log", "")
    try:
        server.wait_ready()
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
        name = client.models.list().data[0].id
        client.embeddings.create(model=name, input="A first request warms the server up.")
        texts = [q for q, _ in qa] + [d for _, d in qa]
        t = time.perf_counter()
        r = client.embeddings.create(model=name, input=texts)
        seconds = time.perf_counter() - t
        t = time.perf_counter()
        short = client.embeddings.create(model=name, input=texts[: len(qa)])
        short_seconds = time.perf_counter() - t
    finally:
        server.stop()
    vectors = [d.embedding for d in r.data]
    top1, mrr = scores(vectors[: len(qa)], vectors[len(qa) :])
    tokens = r.usage.prompt_tokens
    return {
        "pooling": pooling,
        "top1": round(top1, 3),
        "mrr": round(mrr, 3),
        "inputs": len(texts),
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_second": round(tokens / seconds, 1),
        "queries_tokens": short.usage.prompt_tokens,
        "queries_seconds": round(short_seconds, 2),
        "queries_tokens_per_second": round(short.usage.prompt_tokens / short_seconds, 1),
        "dimensions": len(vectors[0]),
        "norm": round(math.sqrt(sum(x * x for x in vectors[0])), 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("text", type=Path)
    p.add_argument("--model", default=None, help="the model to serve (default: the default)")
    p.add_argument("--pairs", type=int, default=40)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    from mlxkv.bench.corpus import read_text

    qa = pairs(read_text(args.text), args.pairs)
    top1, mrr = lexical(qa)
    rows = [
        {"pooling": "chance", "top1": round(1 / len(qa), 3), "mrr": None},
        {"pooling": "shared words (Jaccard)", "top1": round(top1, 3), "mrr": round(mrr, 3)},
    ]
    for row in rows:
        print(json.dumps(row), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for pooling in ("last", "mean"):
            rows.append(run(args.model, pooling, qa, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
