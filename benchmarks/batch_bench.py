"""Throughput of ``mlxkv batch`` vs one-by-one generation vs mlx-lm ``batch_generate``.

    python benchmarks/batch_bench.py [--prompts 16] [--max-tokens 128] [--rounds 3]
        [--kv-window W --kv-sinks S --kv-bits B] [--document 2000]

Same prompts (chat template applied, same token ids), same model, greedy, same cache
policy on the mlxkv sides. mlx-lm gets ``max_kv_size = S + W`` for a window (its rotating
cache, batched without sinks: the nearest it has) and is left out for ``--kv-bits`` (it
has no batched quantized cache). ``--document N`` asks every prompt a question about one
N-token document (one shared prefix); then "mlxkv batch, no sharing" (the row loop with
prefix sharing off) runs too.
- mlxkv batch: the command's ``run`` (``mlxkv.cli.main``) given the loaded model, or with
  ``--subprocess`` the real CLI in a new process; its ``--stats`` elapsed time excludes
  the model load and includes prefill, decoding and writing the results file.
- one by one: the engine's Session (what ``mlxkv generate`` runs), prompt after prompt.
- mlx-lm: ``batch_generate`` with its defaults (completion batch 32, prefill batch 8).
Throughput = generated tokens / wall time. The machine is shared, so the three run
interleaved, round after round, and we report medians and the median of per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlxkv.backend import setup_blas

setup_blas()  # route MLX to OpenBLAS before anything imports MLX

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


def policy_flags(args) -> list[str]:
    out = []
    for flag, v in (("--kv-window", args.kv_window), ("--kv-sinks", args.kv_sinks),
                    ("--kv-bits", args.kv_bits)):  # fmt: skip
        if v is not None:
            out += [flag, str(v)]
    return out


def policy_of(args):
    from mlxkv.policy import KVPolicy

    return KVPolicy.from_flags(args.kv_window, args.kv_sinks, args.kv_bits)


def run_mlxkv_batch(
    loaded, qs, max_tokens, batch_size, workdir: Path, subprocess_: bool, flags=(), share=True
):
    """The ``mlxkv batch`` command; in process (default) it is handed the already loaded
    model, so both batched runners start warm; ``--subprocess`` runs the real CLI cold."""
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

        from mlxkv.cli import main as cli_main
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
            cli_main(argv)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sequential-rounds", type=int, default=None, help="default: --rounds")
    ap.add_argument(
        "--sequential-prompts",
        type=int,
        default=None,
        help="one by one runs only the first N prompts (its tok/s barely depends on N); "
        "default: all",
    )
    ap.add_argument("--subprocess", action="store_true", help="run mlxkv batch as a new process")
    ap.add_argument("--kv-window", type=int)
    ap.add_argument("--kv-sinks", type=int)
    ap.add_argument("--kv-bits", type=int)
    ap.add_argument("--document", type=int, default=0, help="tokens of one shared document")
    args = ap.parse_args()

    from mlxkv.models.loader import load
    from mlxkv.models.resolve import resolve

    loaded = load(resolve(None).path)
    doc = make_document(loaded.tokenizer, args.document) if args.document else ""
    qs = prompts(args.prompts, doc)
    policy, flags = policy_of(args), policy_flags(args)
    lm_kv = None if policy.window is None else policy.window + policy.sinks
    with_lm = policy.bits is None
    seq_rounds = args.rounds if args.sequential_rounds is None else args.sequential_rounds
    runs: dict[str, list[dict]] = {"mlxkv_batch": [], "mlx_lm_batch_generate": [], "one_by_one": []}
    if doc:
        runs["mlxkv_batch_no_sharing"] = []
    with tempfile.TemporaryDirectory() as tmp:
        run_mlx_lm(loaded, qs[:2], 4)  # warm-up (first-call allocations)
        for r in range(args.rounds):
            common = (loaded, qs, args.max_tokens, args.batch_size, Path(tmp), args.subprocess)
            runs["mlxkv_batch"].append(run_mlxkv_batch(*common, flags))
            if doc:
                runs["mlxkv_batch_no_sharing"].append(run_mlxkv_batch(*common, flags, False))
            if with_lm:
                runs["mlx_lm_batch_generate"].append(run_mlx_lm(loaded, qs, args.max_tokens, lm_kv))
            if r < seq_rounds:
                seq = qs[: args.sequential_prompts or len(qs)]
                runs["one_by_one"].append(run_one_by_one(loaded, seq, args.max_tokens, policy))
            done = {k: [round(x["tokens"] / x["seconds"], 2) for x in v] for k, v in runs.items()}
            print(f"round {r + 1}: tok/s {done}", file=sys.stderr, flush=True)

    def tps(x):
        return x["tokens"] / x["seconds"]

    med = {k: statistics.median(map(tps, v)) for k, v in runs.items() if v}

    def paired(a, b):
        """Per-round ratios: both sides saw the same load on the shared machine."""
        return [tps(x) / tps(y) for x, y in zip(runs[a], runs[b], strict=False)]

    paired_seq = paired("mlxkv_batch", "one_by_one")
    paired_lm = paired("mlxkv_batch", "mlx_lm_batch_generate")
    paired_share = paired("mlxkv_batch", "mlxkv_batch_no_sharing") if doc else []
    report = {
        "policy": policy.describe(),
        "mlx_lm_max_kv_size": lm_kv if with_lm else "n/a (no batched quantized cache)",
        "document_tokens": args.document,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "batch_size": args.batch_size,
        "rounds": args.rounds,
        "mlxkv_in_subprocess": args.subprocess,
        "tokens": {k: [x["tokens"] for x in v] for k, v in runs.items()},
        "seconds": {k: [round(x["seconds"], 2) for x in v] for k, v in runs.items()},
        "tok_per_s": {k: [round(tps(x), 2) for x in v] for k, v in runs.items()},
        "median_tok_per_s": {k: round(v, 2) for k, v in med.items()},
        "ratio_vs_one_by_one": round(statistics.median(paired_seq), 2) if paired_seq else None,
        "ratio_vs_mlx_lm": round(statistics.median(paired_lm), 3) if paired_lm else None,
        "ratio_shared_vs_unshared": round(statistics.median(paired_share), 2)
        if paired_share
        else None,
        "kv": {k: v for k, v in runs["mlxkv_batch"][-1].items() if k.startswith(("kv_", "shared"))},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
