"""An agent workload against ``mlxkv serve`` and ``mlx_lm.server`` (its prompt cache on).

Each conversation starts with a long system prompt (a passage of the corpus: the agent's
instructions and documents) and a task; every turn the model answers (greedy, a few
tokens) and the "tool" replies with a new passage, sent as a user message. Conversations
take turns round robin, as agents waiting on their tools do, so a cache that keeps fewer
conversations than are running evicts the one that is needed next.

Both servers load the same float32 weights (``mlxkv.bench.serve.float32_copy``) and run at
once; for each budget, one server then the other drives the whole workload (order swapped
every round). Measured per turn: time to first token (request sent -> first text chunk),
prompt tokens and the cached tokens each server reports in ``usage``; per run: total time,
hit rate (cached / prompt tokens over turns 2+), peak resident memory of the server.

Budgets: ``room`` gives both prefix caches room for every conversation; ``tight`` gives
both the same byte cap (``--prefix-cache-bytes`` / ``--prompt-cache-bytes``) sized to hold
about a quarter of the conversations' full-precision caches; mlxkv serves that run under
``--kv-bits 4`` (its entries are about 4x smaller, so the same bytes hold more) with its
disk tier (entries evicted from memory are read back from files instead of prefilled
again; ``disk=False`` measures the memory tier alone).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from mlxkv.bench.serve import ServerProcess, float32_copy, free_port, stream_chat


def passages(corpus: Path, count: int, tokens: int, tokenizer) -> list[str]:
    """``count`` consecutive passages of about ``tokens`` tokens each from ``corpus``."""
    text = corpus.read_text(encoding="utf-8", errors="replace")
    words = text.split()
    out, at = [], 5000  # skip the front matter
    for _ in range(count):
        n = tokens * 3 // 4
        while True:
            piece = " ".join(words[at : at + n])
            have = len(tokenizer.encode(piece))
            if have >= tokens or at + n >= len(words):
                break
            n += max((tokens - have) * 3 // 4, 8)
        out.append(piece)
        at += n
    return out


def workload(corpus: Path, tokenizer, conversations: int, turns: int, start: int, step: int):
    """Per conversation: the system passage, the task, and one tool passage per turn."""
    docs = passages(corpus, conversations, start, tokenizer)
    tools = passages(corpus, conversations * turns, step, tokenizer)
    return [
        {
            "system": "You are an agent. Read the documents and answer briefly.\n\n" + docs[c],
            "task": f"Task {c}: summarise what happens next in one sentence.",
            "tools": tools[c * turns : (c + 1) * turns],
        }
        for c in range(conversations)
    ]


def drive(server: ServerProcess, convs: list[dict], turns: int, max_tokens: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=3600)
    history = [
        [{"role": "system", "content": c["system"]}, {"role": "user", "content": c["task"]}]
        for c in convs
    ]
    rows = []
    server.reset_peak()
    t0 = time.perf_counter()
    for t in range(turns):
        for i, c in enumerate(convs):
            first, text, usage = stream_chat(client, server.model, history[i], max_tokens)
            details = usage.prompt_tokens_details
            rows.append(
                {
                    "turn": t,
                    "conversation": i,
                    "ttft_s": round(first, 3),
                    "prompt_tokens": usage.prompt_tokens,
                    "cached_tokens": (details.cached_tokens if details else 0) or 0,
                }
            )
            history[i] += [
                {"role": "assistant", "content": "".join(text)},
                {"role": "user", "content": "Tool output:\n" + c["tools"][t]},
            ]
    return {
        "wall_s": round(time.perf_counter() - t0, 2),
        "peak_rss": server.peak_rss(),
        "turns": rows,
    }


def summary(run: dict) -> dict:
    later = [r for r in run["turns"] if r["turn"] > 0]
    prompt = sum(r["prompt_tokens"] for r in later)
    per_turn = {}
    for t in sorted({r["turn"] for r in run["turns"]}):
        per_turn[t] = statistics.median(r["ttft_s"] for r in run["turns"] if r["turn"] == t)
    return {
        "hit_rate": sum(r["cached_tokens"] for r in later) / prompt if prompt else 0.0,
        "ttft_by_turn": per_turn,
        "wall_s": run["wall_s"],
        "peak_rss_mib": (run["peak_rss"] or 0) / 2**20,
    }


def servers(
    model: Path, workdir: Path, budget: str, cap: int | None, disk: bool
) -> list[ServerProcess]:
    p1, p2 = free_port(), free_port()
    mine = [sys.executable, "-m", "mlxkv", "serve", str(model), "--port", str(p1)]
    mine += ["--no-access-log", "--prefix-cache-dir", str(workdir / f"prefixes-{budget}")]
    theirs = [sys.executable, "-c", _MLX_LM, "--model", str(model), "--port", str(p2)]
    theirs += ["--log-level", "WARNING"]
    if cap is not None:
        mine += ["--prefix-cache-bytes", str(cap), "--kv-bits", "4"]
        if not disk:
            mine += ["--prefix-cache-disk-bytes", "0"]  # the memory tier alone, like mlx_lm's
        theirs += ["--prompt-cache-bytes", str(cap)]
    return [
        ServerProcess("mlxkv serve", mine, p1, workdir / f"mlxkv-{budget}.log", model.name),
        ServerProcess("mlx_lm.server", theirs, p2, workdir / f"mlx_lm-{budget}.log", str(model)),
    ]


_MLX_LM = (
    "import sys; from mlxkv.backend import setup_blas; setup_blas(); "
    "from mlx_lm.server import main; sys.argv[0] = 'mlx_lm.server'; main()"
)


def run(
    workdir: Path,
    corpus: Path,
    conversations: int = 8,
    turns: int = 10,
    start: int = 2000,
    step: int = 200,
    max_tokens: int = 16,
    rounds: int = 1,
    budgets: tuple[str, ...] = ("room", "tight"),
    disk: bool = True,
    on_run=print,
) -> list[dict]:
    from mlxkv.models.loader import load

    workdir.mkdir(parents=True, exist_ok=True)
    model = float32_copy(workdir / "smollm2-135m-float32")
    tokenizer = load(model).tokenizer
    convs = workload(corpus, tokenizer, conversations, turns, start, step)
    # a conversation's full-precision KV at its last turn, float32, 256-token steps
    last = start + turns * (step + max_tokens + 20)
    per_conv = -(-last // 256) * 256 * 46080
    results = []
    for budget in budgets:
        cap = None if budget == "room" else max(per_conv * conversations // 4, 1)
        procs = servers(model, workdir, budget, cap, disk)
        try:
            for p in procs:
                p.wait_ready()
            for r in range(rounds):
                for p in procs if r % 2 == 0 else procs[::-1]:
                    out = drive(p, convs, turns, max_tokens)
                    out.update(server=p.name, budget=budget, cap_bytes=cap, round=r)
                    out["summary"] = summary(out)
                    on_run(json.dumps({k: v for k, v in out.items() if k != "turns"}))
                    results.append(out)
        finally:
            for p in procs:
                p.stop()
    return results


def table(results: list[dict]) -> str:
    turns = sorted({r["turn"] for res in results for r in res["turns"]})
    head = "| budget | server | hit rate (turns 2+) | total (s) | peak RSS (MiB) | "
    head += " | ".join(f"TTFT t{t + 1} (s)" for t in turns) + " |"
    rows = [head, "|" + "---|" * (5 + len(turns))]
    for res in results:
        s = res["summary"]
        ttft = " | ".join(f"{s['ttft_by_turn'][t]:.2f}" for t in turns)
        rows.append(
            f"| {res['budget']} | {res['server']} | {s['hit_rate']:.0%} | {s['wall_s']:.0f} | "
            f"{s['peak_rss_mib']:.0f} | {ttft} |"
        )
    return "\n".join(rows)
