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
import sys
import tempfile
from pathlib import Path

from mlxkv.backend import setup_blas

setup_blas()  # route MLX to OpenBLAS before anything imports MLX

from mlxkv.bench.batch import (  # noqa: E402
    make_document,
    prompts,
    run_mlx_lm,
    run_mlxkv_batch,
    run_one_by_one,
)
from mlxkv.cli import main as cli_main  # noqa: E402


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
            common = (
                cli_main,
                loaded,
                qs,
                args.max_tokens,
                args.batch_size,
                Path(tmp),
                args.subprocess,
            )
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
