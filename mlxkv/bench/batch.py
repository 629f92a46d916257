"""Batch throughput: ``mlxkv batch`` (the real command) vs the prompts one by one through
the engine vs mlx-lm ``batch_generate``, interleaved per round; ``mlxkv bench``'s batch
section and ``benchmarks/batch_bench.py`` (same prompts, same counting)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

TOPICS = [
    "the ocean", "mountains", "a city at night", "the history of bread", "robots",
    "winter", "friendship", "the moon", "trains", "gardening", "music", "coffee",
    "libraries", "rivers", "deserts", "birds", "volcanoes", "chess", "rain", "bridges",
]  # fmt: skip


def prompts(n: int, document: str = "") -> list[str]:
    if document:
        return [
            f"{document}\n\nQuestion {i + 1}: what does the text above say about "
            f"{TOPICS[i % len(TOPICS)]}? Answer in detail."
            for i in range(n)
        ]
    return [f"Write a long, detailed essay about {TOPICS[i % len(TOPICS)]}." for i in range(n)]


def make_document(tokenizer, tokens: int) -> str:
    """Deterministic prose of about ``tokens`` tokens."""
    words, i = [], 0
    while True:
        t = TOPICS[i % len(TOPICS)]
        words.append(f"Paragraph {i + 1} is about {t}, and how {t} changed over the years.")
        i += 1
        text = " ".join(words)
        if i % 8 == 0 and len(tokenizer.encode(text)) >= tokens:
            return text


def run_mlxkv_batch(
    command: Callable[[list[str]], int],
    loaded,
    qs,
    max_tokens,
    batch_size,
    workdir: Path,
    subprocess_: bool,
    flags=(),
    share=True,
):
    """The ``mlxkv batch`` command: ``command(argv)`` in process (``mlxkv.cli.main``, or
    the batch command's own run), handed the already loaded model so both batched runners
    start warm; with ``subprocess_`` the real CLI in a new process, cold."""
    inp, out = workdir / "in.jsonl", workdir / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": q}) + "\n" for i, q in enumerate(qs)))
    out.unlink(missing_ok=True)
    argv = ["batch", str(inp), "-o", str(out), "--stats", "--no-progress",
            "--max-tokens", str(max_tokens), "--batch-size", str(batch_size),
            *flags]  # fmt: skip
    if subprocess_:
        cmd = [sys.executable, "-m", "mlxkv", *argv]
        stdout = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    else:
        import contextlib
        import io
        from unittest import mock

        from mlxkv.engine import batch as engine_batch

        buf = io.StringIO()
        runner = engine_batch.BatchRunner

        def unshared(*a, **k):
            return runner(*a, **k, share_prefix=False)

        with (
            mock.patch("mlxkv.engine.loading.open_model", lambda *a, **k: loaded),
            mock.patch.object(engine_batch, "BatchRunner", runner if share else unshared),
            contextlib.redirect_stdout(buf),
        ):
            command(argv)
        stdout = buf.getvalue()
    stats = json.loads(stdout)
    kv = {k: v for k, v in stats.items() if k.startswith(("kv_", "shared_"))}
    return {"tokens": stats["generation_tokens"], "seconds": stats["elapsed_s"], **kv}


def run_one_by_one(loaded, qs, max_tokens, policy=None) -> dict:
    from mlxkv.engine.chat import ChatSession
    from mlxkv.engine.events import Finished
    from mlxkv.engine.session import GenerationSettings, Session

    settings = GenerationSettings(max_tokens=max_tokens)
    gen = Session(loaded, policy) if policy else Session(loaded)
    tokens, tic = 0, time.perf_counter()
    for q in qs:
        gen.reset()
        events = ChatSession(gen, settings).send(q)
        tokens += [e for e in events if isinstance(e, Finished)][0].stats.generation_tokens
    return {"tokens": tokens, "seconds": time.perf_counter() - tic}


def run_mlx_lm(loaded, qs, max_tokens, max_kv_size=None) -> dict:
    from mlx_lm.generate import batch_generate

    tok = loaded.tokenizer
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in qs
    ]
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    tic = time.perf_counter()
    extra = {"max_kv_size": max_kv_size} if max_kv_size else {}
    res = batch_generate(
        loaded.model, tok, ids, max_tokens=max_tokens, return_token_ids=True, **extra
    )
    # batch_generate drops the EOS token; mlxkv counts it: count it here too.
    tokens = sum(len(t) + (len(t) < max_tokens) for t in res.token_ids)
    return {"tokens": tokens, "seconds": time.perf_counter() - tic}


def measure(
    loaded, n_prompts: int, max_tokens: int, rounds: int, log, command: Callable[[list[str]], int]
) -> dict:
    """``command`` runs ``mlxkv batch ARGV`` in process (see ``run_mlxkv_batch``)."""
    qs = prompts(n_prompts)
    runs = {"mlxkv_batch": [], "one_by_one": [], "mlx_lm_batch_generate": []}
    with tempfile.TemporaryDirectory() as tmp:
        run_mlx_lm(loaded, qs[:2], 2)  # warm-up
        for r in range(rounds):
            runs["mlxkv_batch"].append(
                run_mlxkv_batch(command, loaded, qs, max_tokens, len(qs), Path(tmp), False)
            )
            runs["mlx_lm_batch_generate"].append(run_mlx_lm(loaded, qs, max_tokens))
            runs["one_by_one"].append(run_one_by_one(loaded, qs, max_tokens))
            tps = {k: round(v[-1]["tokens"] / v[-1]["seconds"], 1) for k, v in runs.items()}
            log(f"batch round {r + 1}/{rounds}: tok/s {tps}")

    def tps(x):
        return x["tokens"] / x["seconds"]

    def paired(a, b):
        return statistics.median(tps(x) / tps(y) for x, y in zip(runs[a], runs[b], strict=True))

    return {
        "mode": "in process",
        "prompts": n_prompts,
        "max_tokens": max_tokens,
        "batch_size": n_prompts,
        "rounds": rounds,
        "median_tps": {k: statistics.median(map(tps, v)) for k, v in runs.items()},
        "tokens": {k: [x["tokens"] for x in v] for k, v in runs.items()},
        "ratio_vs_one_by_one": paired("mlxkv_batch", "one_by_one"),
        "ratio_vs_mlx_lm": paired("mlxkv_batch", "mlx_lm_batch_generate"),
    }
