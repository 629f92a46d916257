"""Where ``truncation: "auto"`` cuts a long conversation, and what each choice costs.

    python benchmarks/truncation_bench.py [--context 2048] [--turns 40] [--grains 0,8,4,2]
        [--corpus ../shared/data/austen.txt] [--json OUT.json]

One conversation of corpus paragraphs (a user paragraph, a fixed assistant paragraph per
turn) goes past a model context of ``--context`` tokens; every turn is cut by
``mlxkv.server.truncation.fitted`` with the room cut into ``--grains`` grains (0: a cut of
just enough tokens) and answered by the server's engine (the default model, a prefix cache
in memory) with one token. Per setting: the prompt tokens prefilled (not from the cache),
the time to the first token, and the tokens of conversation the model still sees.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from mlxkv.backend import setup_blas

setup_blas()


def conversation(corpus: Path, tokenizer, turns: int) -> list[dict]:
    paras = [p.strip() for p in corpus.read_text().split("\n\n") if len(p.split()) > 60]
    msgs = [{"role": "system", "content": "You summarize what the user reads to you."}]
    for i in range(turns):
        user = " ".join(paras[2 * i % len(paras)].split()[:110])
        said = " ".join(paras[(2 * i + 1) % len(paras)].split()[:50])
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": said}]
    return msgs


def main() -> None:
    from mlxkv.engine.events import Finished
    from mlxkv.engine.prefix_cache import PrefixCache
    from mlxkv.engine.request import GenerationSettings
    from mlxkv.engine.scheduler import Request, Scheduler
    from mlxkv.models.loader import load
    from mlxkv.models.resolve import resolve
    from mlxkv.server.truncation import answer_room, fitted

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=2048, help="the context the cut fits")
    p.add_argument("--turns", type=int, default=40)
    p.add_argument("--grains", default="0,8,4,2", help="0: cut just enough tokens")
    here = Path(__file__).resolve().parents[1]
    p.add_argument("--corpus", type=Path, default=here.parent / "shared" / "data" / "austen.txt")
    p.add_argument("--json", type=Path, default=None, help="write every turn here")
    args = p.parse_args()

    loaded = load(resolve(None).path)
    tok = loaded.tokenizer
    msgs = conversation(args.corpus, tok, args.turns)
    room = args.context - answer_room(1, args.context)

    def count(messages: list[dict], whole: bool) -> int | None:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=whole)
        return len(tok.encode(text, add_special_tokens=False))

    runs = {}
    for grains in (int(g) for g in args.grains.split(",")):
        sched = Scheduler(loaded, prefix_cache=PrefixCache(1 << 30, loaded.model))
        rows = []
        for t in range(1, args.turns + 1):
            asked = msgs[: 2 * t]  # the system message and t user turns, the last unanswered
            kept = fitted(asked, count, room, grains or room)
            text = tok.apply_chat_template(kept, tokenize=False, add_generation_prompt=True)
            ids = sched.encode(text)
            start = time.perf_counter()
            h = sched.submit(Request(ids, GenerationSettings(max_tokens=1)))
            done = next(e for e in h.events() if isinstance(e, Finished))
            s = done.stats
            rows.append(
                {
                    "turn": t,
                    "prompt": s.prompt_tokens,
                    "cached": s.prompt_tokens_cached,
                    "seconds": time.perf_counter() - start,
                    "truncated": kept is not asked,
                }
            )
        sched.close()
        runs[grains] = rows
        print(json.dumps({"grains": grains, "rows": rows}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    cut = min(r["turn"] for rows in runs.values() for r in rows if r["truncated"])
    print(f"\ncontext {args.context}, room {room}; turns {cut}..{args.turns} (past the first cut)")
    print(
        "| grains | prompt tokens prefilled | turns with most of the prompt cached "
        "| seconds to first token (sum) | median | tokens seen (mean) |"
    )
    print("|---|---|---|---|---|---|")
    for grains, rows in runs.items():
        late = [r for r in rows if r["turn"] >= cut]
        name = "just enough" if grains == 0 else f"{grains} (a grain {room // grains} tokens)"
        prefilled = sum(r["prompt"] - r["cached"] for r in late)
        reused = sum(r["cached"] > r["prompt"] // 2 for r in late)
        secs = [r["seconds"] for r in late]
        seen = statistics.mean(r["prompt"] for r in late)
        print(
            f"| {name} | {prefilled} | {reused} of {len(late)} | {sum(secs):.1f} | "
            f"{statistics.median(secs):.2f} | {seen:.0f} |"
        )


if __name__ == "__main__":
    main()
