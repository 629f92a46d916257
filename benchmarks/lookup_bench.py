"""Drafts from the conversation (prompt lookup decoding): how many a greedy answer keeps,
and what that does to its speed, on the real model.

    python benchmarks/lookup_bench.py [--model M] [--max-tokens 160] [--drafts 2,4,8]
                                      [--json OUT.json] [--quantized | --temperature T]
                                      [--repetition-penalty R]

Four prompts: two whose answers copy from the prompt (edit a piece of code, copy a
passage), two that do not (a question, a summary). For each:

* measured: the engine's greedy answer with ``draft_tokens`` 0 and each of ``--drafts``
  (its rule: 2- and 3-grams, the draft length adapting up to that many):
  decode tokens per second (the answer's tokens after the first over the time since the
  first), drafts checked and taken, and whether the answer is the plain one token for token;
* measured, with OpenAI's predicted output: the largest ``--drafts`` given the text a client
  would send as the prediction (the code it asked to have edited, the passage to copy; for
  the other two the plain answer itself, as a client that knew it: an upper bound);
* replayed: other lookup rules (n-gram lengths, a draft length that adapts) on the plain
  answer, which greedy drafts cannot change: tokens a step, and the speed-up the model's
  measured cost of a step of 1 + k tokens at this context predicts.

``--temperature T`` instead samples each prompt's answer (``--draws`` of them, MLX's
global key seeded 0, 1, ...) with no drafts and with the largest ``--drafts``: a sampled
answer keeps each draft with its sampler's probability of it (speculative sampling), so
the answers differ draw by draw and what is compared is their speed and drafts taken.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from mlxkv.backend import setup_blas

setup_blas()

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "data" / "austen.txt"


# the code to edit: a fixed excerpt of mlxkv/engine/lookup.py (the tables in docs/serve.md)
CODE = (
    "class PromptLookup:\n"
    '    """The tokens of one request (its prompt, then its answer as it is fed), indexed."""\n'
    "\n"
    "    def __init__(\n"
    "        self,\n"
    "        prompt: list[int],\n"
    "        hint: list[int] | tuple[int, ...] = (),\n"
    "        ngram_min: int = NGRAM_MIN,\n"
    "        ngram_max: int = NGRAM_MAX,\n"
    "    ):\n"
    '        """``hint``: the answer\'s expected tokens (a predicted output), indexed after the\n'
    "        prompt so that its continuations win over the prompt's, but never part of what\n"
    '        the last tokens are."""\n'
    "        self.ngram_min, self.ngram_max = ngram_min, ngram_max\n"
    "        self.tokens: list[int] = []\n"
    "        self.hint = list(hint)\n"
    "        # n-gram -> position after its latest occurrence: in ``tokens`` (>= 0) or, as\n"
    "        # -1 - i, at ``hint[i]``\n"
    "        self._after: dict[tuple[int, ...], int] = {}\n"
    "        self._answer = 0  # answer tokens already added\n"
    "        self.extend(prompt)\n"
    "        for end in range(1, len(self.hint)):\n"
    "            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):\n"
    "                self._after[tuple(self.hint[end - n : end])] = -1 - end\n"
    "\n"
    "    def extend(self, tokens: list[int]) -> None:\n"
    "        seq, after = self.tokens, self._after\n"
    "        for t in tokens:\n"
    "            end = len(seq)  # the n-grams ending just before ``t`` are followed by it\n"
    "            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):\n"
    "                after[tuple(seq[end - "
)


def prompts() -> dict[str, tuple[str, str | None]]:
    """name -> (prompt, the predicted output a client would send: the file it asked to
    have edited, the passage to copy; None: the plain answer, as a client that knew it)."""
    code = CODE
    text = CORPUS.read_text(encoding="utf-8") if CORPUS.exists() else code
    para = " ".join(text[20000:21200].split())
    return {
        "edit code": (f"Rename the class to `Guess` and give back the whole code:\n\n{code}", code),
        "copy a passage": (f"Copy this passage word for word:\n\n{para}", para),
        "question": ("Why is the sky blue? Explain in a few paragraphs.", None),
        "summary": (f"Summarize this passage in three sentences:\n\n{para}", None),
    }


def step_costs(loaded, ids: list[int], feeds=(1, 2, 3, 5, 9, 13), reps: int = 5) -> dict:
    """Median seconds of one model call of ``n`` tokens after ``ids`` are cached."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(loaded.model)
    mx.eval(loaded.model(mx.array([ids]), cache=caches))
    out = {}
    for n in feeds:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            mx.eval(loaded.model(mx.array([ids[-n:]]), cache=caches))
            times.append(time.perf_counter() - t)
            for c in caches:
                c.trim(n)
        out[n] = statistics.median(times)
    return out


def cost(costs: dict, n: int) -> float:
    """A step of ``n`` tokens, interpolated between the measured feeds."""
    known = sorted(costs)
    lo = max(k for k in known if k <= n)
    hi = min((k for k in known if k >= n), default=lo)
    if hi == lo:
        return costs[lo] * (n / lo if n > lo else 1.0)
    return costs[lo] + (costs[hi] - costs[lo]) * (n - lo) / (hi - lo)


def replay(prompt, answer, most, ngram_min, ngram_max, adapt, costs) -> dict:
    """The steps a lookup rule takes over a greedy ``answer`` (drafts cannot change it)."""
    from mlxkv.engine.lookup import PromptLookup, adapt_draft_length

    look = PromptLookup(prompt, ngram_min=ngram_min, ngram_max=ngram_max)
    look.extend(answer[:1])
    i, steps, seconds, drafted, taken_all = 0, 0, 0.0, 0, 0
    k = most
    while i < len(answer) - 1:  # feed answer[i], check drafts of answer[i+1:]
        drafts = look.draft(min(k, len(answer) - 1 - i))
        taken = 0
        while taken < len(drafts) and drafts[taken] == answer[i + 1 + taken]:
            taken += 1
        steps += 1
        seconds += cost(costs, 1 + len(drafts))
        drafted, taken_all = drafted + len(drafts), taken_all + taken
        if adapt and drafts:
            k = adapt_draft_length(k, taken, len(drafts), most)
        look.extend(answer[i + 1 : i + 2 + taken])
        i += 1 + taken
    plain = (len(answer) - 1) * costs[1]
    return {
        "tokens_per_step": (len(answer) - 1) / max(steps, 1),
        "drafted": drafted,
        "taken": taken_all,
        "speedup": plain / seconds if seconds else 1.0,
    }


def run(loaded, ids, max_tokens, drafts, prediction=None, policy=None, temperature=0.0, **more):
    from mlxkv.engine.events import Finished, TokenDelta
    from mlxkv.engine.request import GenerationSettings
    from mlxkv.engine.scheduler import Request, Scheduler

    scheduler = Scheduler(loaded, policy, draft_tokens=drafts)
    settings = GenerationSettings(max_tokens=max_tokens, temperature=temperature, **more)
    handle = scheduler.submit(Request(ids, settings, prediction=prediction))
    tokens, tps = [], 0.0
    for ev in handle.events():
        if isinstance(ev, TokenDelta) and ev.token >= 0:
            tokens.append(ev.token)
        if isinstance(ev, Finished):
            tps = ev.stats.generation_tps
    return {"tokens": tokens, "tps": tps, "drafted": scheduler.drafted, "taken": scheduler.accepted}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--drafts", default="2,4,8")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--quantized",
        action="store_true",
        help="instead: under quantized KV policies, where a drafted greedy answer parts from "
        "the undrafted one (100 tokens at most)",
    )
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument(
        "--repetition-penalty",
        type=float,
        default=0.0,
        help="the measured greedy answers with this repetition penalty (a logits processor "
        "applied at every drafted position)",
    )
    ap.add_argument("--draws", type=int, default=3)
    args = ap.parse_args()
    from mlxkv.models.loader import load
    from mlxkv.models.resolve import resolve

    loaded = load(resolve(args.model).path)
    tok = loaded.tokenizer
    if args.quantized:
        return quantized(loaded, max(int(x) for x in args.drafts.split(",")))
    if args.temperature > 0:
        most = max(int(x) for x in args.drafts.split(","))
        return sampled(loaded, args.temperature, most, args.draws, args.max_tokens)
    penalty = {"repetition_penalty": args.repetition_penalty} if args.repetition_penalty else {}
    measured, replayed = [], []
    for name, (text, predicted) in prompts().items():
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        costs = step_costs(loaded, ids)
        plain = run(loaded, ids, args.max_tokens, 0, **penalty)
        row = {"prompt": name, "ids": len(ids)}
        measured.append({**row, "drafts": "0", **_public(plain, plain)})
        most = [int(x) for x in args.drafts.split(",")]
        for k in most:
            got = run(loaded, ids, args.max_tokens, k, **penalty)
            measured.append({**row, "drafts": str(k), **_public(got, plain)})
        hint = tok.encode(predicted, add_special_tokens=False) if predicted else plain["tokens"]
        got = run(loaded, ids, args.max_tokens, max(most), hint, **penalty)
        label = f"{max(most)}, predicted: " + ("the source" if predicted else "the answer")
        measured.append({**row, "drafts": label, **_public(got, plain)})
        answer = plain["tokens"]
        for rule in RULES:
            r = replay(ids, answer, *rule, costs)
            replayed.append({"prompt": name, "rule": _rule_name(rule), **r})
        print(
            f"{name}: {len(ids)} prompt tokens, steps of 1/5/9: "
            f"{costs[1] * 1e3:.1f}/{costs[5] * 1e3:.1f}/{costs[9] * 1e3:.1f} ms",
            flush=True,
        )
    print("\n| prompt | drafts | decode tok/s | drafted | taken | same answer |")
    print("|---|---:|---:|---:|---:|---|")
    for m in measured:
        print(
            f"| {m['prompt']} | {m['drafts']} | {m['tps']:.1f} | {m['drafted']} | "
            f"{m['taken']} | {m['same']} |"
        )
    print("\n| prompt | rule | tokens a step | drafted | taken | predicted speed-up |")
    print("|---|---|---:|---:|---:|---:|")
    for r in replayed:
        print(
            f"| {r['prompt']} | {r['rule']} | {r['tokens_per_step']:.2f} | {r['drafted']} | "
            f"{r['taken']} | {r['speedup']:.2f}x |"
        )
    if args.json:
        args.json.write_text(json.dumps({"measured": measured, "replayed": replayed}, indent=1))
    return 0


# the novel's first sentences, as tests/test_lookup.py asks for them to be copied
OPENING = (
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife. However little known the feelings or views of such "
    "a man may be on his first entering a neighbourhood, this truth is so well fixed in the "
    "minds of the surrounding families, that he is considered as the rightful property of "
    "some one or other of their daughters."
)


def quantized(loaded, most: int) -> int:
    """A quantized cache attends in a step of several tokens over its dequantized keys and
    in a step of one over the packed ones: the drafted answer may part from the plain one."""
    from mlxkv.policy import KVPolicy

    policies = {
        "KIVI 4-bit keys": KVPolicy(key_bits=4),
        "KIVI 8-bit keys": KVPolicy(key_bits=8),
        "4-bit rotated keys and values": KVPolicy(bits=4, key_scheme="rotated"),
        "8-bit rotated keys and values": KVPolicy(bits=8, key_scheme="rotated"),
    }
    print("| prompt | policy | plain tokens | drafted tokens | drafts taken | parts at token |")
    print("|---|---|---:|---:|---:|---|")
    asks = {k: v for k, v in prompts().items() if k in ("copy a passage", "question")}
    asks["copy the opening"] = (f"Copy this passage word for word:\n\n{OPENING}", None)
    for name, (text, _) in asks.items():
        msg = [{"role": "user", "content": text}]
        ids = loaded.tokenizer.apply_chat_template(msg, add_generation_prompt=True)
        for label, policy in policies.items():
            plain = run(loaded, ids, 100, 0, policy=policy)["tokens"]
            got = run(loaded, ids, 100, most, policy=policy)
            pairs = zip(plain, got["tokens"], strict=False)  # (lengths may differ)
            parts = next((i + 1 for i, (a, b) in enumerate(pairs) if a != b), None)
            if parts is None and len(plain) != len(got["tokens"]):
                parts = min(len(plain), len(got["tokens"])) + 1
            print(
                f"| {name} | {label} | {len(plain)} | {len(got['tokens'])} | {got['taken']} | "
                f"{parts or 'same answer'} |",
                flush=True,
            )
    return 0


def sampled(loaded, temperature: float, most: int, draws: int, max_tokens: int) -> int:
    """Sampled answers with and without drafts, the two interleaved draw by draw (the same
    seeds for both): mean decode tok/s over ``draws`` draws, drafts taken / checked, answer
    tokens."""
    import mlx.core as mx

    tok = loaded.tokenizer
    print(f"| prompt | drafts | decode tok/s (mean of {draws}) | taken / checked | tokens |")
    print("|---|---:|---:|---:|---:|")
    for name, (text, _) in prompts().items():
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        got: dict[int, list] = {0: [], most: []}
        for seed in range(draws):
            for k in got:
                mx.random.seed(seed)
                got[k].append(run(loaded, ids, max_tokens, k, temperature=temperature))
        plain = statistics.mean(g["tps"] for g in got[0])
        for k, runs in got.items():
            tps = statistics.mean(g["tps"] for g in runs)
            taken, drafted = sum(g["taken"] for g in runs), sum(g["drafted"] for g in runs)
            n = sum(len(g["tokens"]) for g in runs)
            print(
                f"| {name} | {k} | {tps:.1f} ({tps / plain:.2f}x) | {taken}/{drafted} | {n} |",
                flush=True,
            )
    return 0


# (most drafts, n-gram min, n-gram max, adapt the draft length)
RULES = [
    (4, 1, 3, False),
    (8, 1, 3, False),
    (4, 2, 3, False),
    (8, 2, 4, False),
    (4, 1, 3, True),
    (8, 1, 3, True),
    (8, 2, 3, True),
    (8, 2, 4, True),
    (12, 2, 3, True),
]


def _rule_name(rule) -> str:
    most, lo, hi, adapt = rule
    return f"{most} drafts, {lo}-{hi}-grams" + (", adaptive" if adapt else "")


def _public(got: dict, plain: dict) -> dict:
    return {
        "tps": got["tps"],
        "drafted": got["drafted"],
        "taken": got["taken"],
        "same": got["tokens"] == plain["tokens"],
        "answer_tokens": len(got["tokens"]),
    }


if __name__ == "__main__":
    raise SystemExit(main())
