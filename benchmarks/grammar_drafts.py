"""Drafts for answers held to a JSON schema: which tokens a draft step checks, measured on
the default model, in one process.

    python benchmarks/grammar_drafts.py [--rounds 2] [--tokens 160] [--drafts 8]

Four structured-output requests of the kind agents send (a record, an extraction from a
passage, a list of records, a classification), each answered greedily by the scheduler
alone, under five rules for what a step checks after the token it feeds:

* ``off``: nothing (one token a step; ``--draft-tokens 0``);
* ``guesses``: the conversation's guesses (prompt lookup), cut where the grammar stops
  allowing them;
* ``forced``: the tokens the grammar forces there (a schema's keys and punctuation;
  llguidance's fast-forward tokens, SGLang's jump-forward decoding), else nothing;
* ``forced, else guesses``: the forced tokens where there are any, else the guesses;
* ``forced, then guesses``: the forced tokens, then the guesses after them, in the same
  step (the rule mlxkv uses).

Prints, per request and rule, decode tok/s (the answer's tokens after the first over the
time since the first; median of ``--rounds``, the rules' order alternating), model steps
after the first token, drafts checked and taken, and whether the text is the ``off``
answer byte for byte (a greedy answer does not depend on its drafts).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from mlxkv.backend import setup_blas

setup_blas()  # route MLX to OpenBLAS before anything imports MLX

from mlxkv.engine.events import Finished  # noqa: E402
from mlxkv.engine.grammar import GrammarProcessor, json_grammar  # noqa: E402
from mlxkv.engine.scheduler import Request, Scheduler  # noqa: E402
from mlxkv.engine.session import GenerationSettings  # noqa: E402
from mlxkv.models.loader import load  # noqa: E402
from mlxkv.models.resolve import resolve  # noqa: E402

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "austen.txt"
SHIPPED = GrammarProcessor.drafts


def _string(n=60):
    return {"type": "string", "maxLength": n}


def _object(props: dict) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


def _passage() -> str:
    text = CORPUS.read_text(encoding="utf-8") if CORPUS.exists() else ""
    start = text.find("Mr. Bennet")
    return (
        " ".join(text[start : start + 900].split())
        if start >= 0
        else (
            "Mr. Bennet was so odd a mixture of quick parts, sarcastic humour, reserve, and "
            "caprice, that the experience of three-and-twenty years had been insufficient to "
            "make his wife understand his character. Her mind was less difficult to develop."
        )
    )


PASSAGE = _passage()
REQUESTS = {
    "record": (
        "Describe Ada Lovelace as JSON.",
        _object(
            {
                "name": _string(),
                "birth_year": {"type": "integer"},
                "occupation": _string(),
                "known_for": {"type": "array", "items": _string(), "maxItems": 4},
            }
        ),
    ),
    "extraction": (
        f"Extract every person named in this passage, as JSON.\n\n{PASSAGE}",
        _object(
            {
                "people": {
                    "type": "array",
                    "items": _object({"name": _string(), "described_as": _string()}),
                    "maxItems": 5,
                }
            }
        ),
    ),
    "list": (
        "List three classic English novels as JSON.",
        _object(
            {
                "novels": {
                    "type": "array",
                    "items": _object(
                        {
                            "title": _string(),
                            "author": _string(),
                            "publication_year": {"type": "integer"},
                        }
                    ),
                    "minItems": 3,
                    "maxItems": 3,
                }
            }
        ),
    ),
    "classification": (
        f"Classify the tone of this passage, as JSON.\n\n{PASSAGE}",
        _object(
            {
                "tone": {"enum": ["humorous", "serious", "sad", "angry", "neutral"]},
                "confidence": {"type": "number"},
                "evidence": _string(200),
            }
        ),
    ),
}


def _guesses(self, pending, guess, most):
    """The guesses the grammar allows, whether or not it forces something there."""
    if pending in self.ends:
        return []
    tokens = guess((), most)
    self.matcher.consume_token(pending)
    out = tokens[: self.matcher.validate_tokens(tokens)]
    self.matcher.rollback(1)
    return self._before_end(out)


def _forced(self, pending, guess, most):
    """The tokens the grammar forces, nothing else."""
    return SHIPPED(self, pending, lambda after, n: [], most)


def _forced_else_guesses(self, pending, guess, most):
    """The forced tokens where there are any, else the guesses it allows."""
    return _forced(self, pending, guess, most) or _guesses(self, pending, guess, most)


RULES = {
    "off": None,
    "guesses": _guesses,
    "forced": _forced,
    "forced, else guesses": _forced_else_guesses,
    "forced, then guesses": SHIPPED,
}


def main() -> None:
    parser = argparse.ArgumentParser(description="drafts for answers held to a JSON schema")
    parser.add_argument("--rounds", type=int, default=2, help="rounds (the order alternates)")
    parser.add_argument("--tokens", type=int, default=160, help="most tokens per answer")
    parser.add_argument("--drafts", type=int, default=8, help="most drafts a step checks")
    args = parser.parse_args()

    loaded = load(resolve(None).path)

    def answer(question, grammar, rule) -> Finished:
        GrammarProcessor.drafts = SHIPPED if RULES[rule] is None else RULES[rule]
        sched = Scheduler(loaded, draft_tokens=0 if RULES[rule] is None else args.drafts)
        ids = loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True
        )
        settings = GenerationSettings(max_tokens=args.tokens, grammar=grammar)
        handle = sched.submit(Request(ids, settings))
        return [e for e in handle.events() if isinstance(e, Finished)][0]

    print(f"{args.rounds} rounds, {args.tokens} tokens at most, {args.drafts} drafts a step")
    print("| request | rule | decode tok/s | steps | drafts taken / checked | same text |")
    print("|---|---|---|---|---|---|")
    for name, (question, schema) in REQUESTS.items():
        grammar = json_grammar(schema)
        speeds: dict[str, list[float]] = {rule: [] for rule in RULES}
        last: dict[str, Finished] = {}
        for r in range(args.rounds):
            for rule in RULES if r % 2 == 0 else reversed(RULES):
                done = answer(question, grammar, rule)
                speeds[rule].append(done.stats.generation_tps)
                last[rule] = done
        for rule in RULES:
            s = last[rule].stats
            steps = s.generation_tokens - 1 - s.draft_tokens_accepted
            same = "yes" if last[rule].text == last["off"].text else "NO"
            print(
                f"| {name} ({s.generation_tokens} tokens) | {rule} | "
                f"{statistics.median(speeds[rule]):.1f} | {steps} | "
                f"{s.draft_tokens_accepted} / {s.draft_tokens} | {same} |",
                flush=True,
            )
    GrammarProcessor.drafts = SHIPPED


if __name__ == "__main__":
    main()
