"""Two checkouts of mlxkv, measured interleaved: the same ``mlxkv generate`` and
``mlxkv batch`` runs under each policy, alternating A-B / B-A every round, so a busy
minute on a shared machine hits both sides alike.

Each run is a fresh process (``python -m mlxkv`` with the checkout first on PYTHONPATH)
and reports its own figures: ``generate --json`` its prefill and decode tok/s (the engine's
single-sequence path, a batch of one), ``batch --stats`` the batch's generated tok/s, once
batched and once one line at a time (``--batch-size 1``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

POLICIES = {
    "full": [],
    "sink4+window252": ["--kv-window", "252", "--kv-sinks", "4"],
    "4-bit": ["--kv-bits", "4"],
    # a window the answer outruns: eviction, sink re-rotation and the KIVI ring wrap
    "sink4+window28": ["--kv-window", "28", "--kv-sinks", "4"],
    "sink4+window28 4-bit": ["--kv-window", "28", "--kv-sinks", "4", "--kv-bits", "4"],
}
STORY = "Write a long story about a dragon who learns to read."
BATCH_PROMPTS = [
    "Write a long story about a dragon who learns to read.",
    "Explain how a steam engine works, step by step.",
    "Describe a walk through a forest in autumn.",
    "Write a letter to a friend about a summer holiday.",
    "List ten facts about the ocean and explain each.",
    "Tell the story of a ship lost at sea.",
    "Explain why the sky is blue to a child.",
    "Write a poem about the moon, then explain it.",
]


def _run(checkout: Path, args: list[str], env: dict) -> str:
    full = {**os.environ, **env, "PYTHONPATH": str(checkout)}
    out = subprocess.run(
        [sys.executable, "-m", "mlxkv", *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=1800,
    )
    if out.returncode not in (0, 1):
        raise RuntimeError(f"{checkout}: mlxkv {' '.join(args)} failed: {out.stderr[-500:]}")
    return out.stdout


def generate(checkout: Path, flags: list[str], max_tokens: int, env: dict) -> dict:
    args = ["generate", "--prompt", STORY, "--max-tokens", str(max_tokens), "--json", *flags]
    return json.loads(_run(checkout, args, env).strip().splitlines()[-1])


def batch(
    checkout: Path, flags: list[str], lines: int, batch_size: int, max_tokens: int, env: dict
) -> dict:
    prompts = BATCH_PROMPTS[:lines]
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "in.jsonl", Path(d) / "out.jsonl"
        src.write_text(
            "".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts))
        )
        args = ["batch", str(src), "-o", str(dst), "--stats", "--no-progress"]
        args += ["--batch-size", str(batch_size), "--max-tokens", str(max_tokens), *flags]
        return json.loads(_run(checkout, args, env).strip().splitlines()[-1])


def measure(
    sides: dict[str, Path],
    rounds: int,
    max_tokens: int,
    lines: int,
    env: dict,
    policies: list[str] | None = None,
) -> dict:
    """{policy: {side: {metric: [values]}}}, interleaved A-B then B-A (every policy of
    ``POLICIES``, or those named)."""
    names = list(sides)
    chosen = {p: f for p, f in POLICIES.items() if policies is None or p in policies}
    res: dict = {p: {n: {} for n in names} for p in chosen}
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for policy, flags in chosen.items():
            for name in order:
                cell = res[policy][name]
                g = generate(sides[name], flags, max_tokens, env)
                cell.setdefault("prefill_tps", []).append(g["prompt_tps"])
                cell.setdefault("decode_tps", []).append(g["generation_tps"])
                cell.setdefault("decode_tokens", []).append(g["generation_tokens"])
                b = batch(sides[name], flags, lines, lines, max_tokens, env)
                cell.setdefault("batch_tps", []).append(b["generation_tps"])
                one = batch(sides[name], flags, lines, 1, max_tokens, env)
                cell.setdefault("one_by_one_tps", []).append(one["generation_tps"])
            print(f"round {r + 1}/{rounds} {policy} done", file=sys.stderr, flush=True)
    return res


def table(res: dict, a: str, b: str) -> str:
    rows = [
        f"| policy | metric | {a} | {b} | {b} / {a} |",
        "|---|---|---:|---:|---:|",
    ]
    for policy, sides in res.items():
        for metric in ("prefill_tps", "decode_tps", "batch_tps", "one_by_one_tps"):
            va, vb = sides[a][metric], sides[b][metric]
            ratios = [y / x for x, y in zip(va, vb, strict=True) if x]
            rows.append(
                f"| {policy} | {metric} | {statistics.median(va):.2f} | "
                f"{statistics.median(vb):.2f} | {statistics.median(ratios):.3f} |"
            )
    return "\n".join(rows)
