"""Constrained decoding: an answer held to a grammar (a JSON schema, or any JSON object),
so that what the model writes parses.

llguidance (the grammar engine of llama.cpp's and vLLM's structured outputs) computes, for
each step, the set of tokens that keep the text on the grammar; the tokens outside it get
-inf before sampling. It runs on the CPU beside any MLX backend (decode at 0.96-1.00x a
free answer's speed alone, 0.95-0.98x in a batch of 8: docs/serve.md#structured-output). Once the
grammar is complete only an end-of-sequence token is allowed, so the answer ends as the
grammar does. An answer that decodes alone is shown drafts (:mod:`mlxkv.engine.lookup`):
the grammar supplies the tokens it forces (a schema's keys and punctuation), reads the
drafts in turn and rolls back those the model does not keep.
"""

from __future__ import annotations

import json
import threading
from collections import deque

from mlxkv.errors import UserError

ANY_OBJECT = {"type": "object"}  # OpenAI's json_object: any JSON object
_tokenizers: dict[int, object] = {}  # id(mlx-lm tokenizer) -> llguidance's view of it
_lock = threading.Lock()


def json_grammar(schema: dict | None) -> str:
    """The grammar of JSON text matching ``schema`` (None: any JSON object); a schema
    llguidance cannot compile is a one-line UserError."""
    import llguidance

    if schema is not None and (bound := _integer_bound_past_64_bits(schema)):
        raise UserError(
            f"the JSON schema cannot be used: {bound} is past what a 64-bit integer holds, "
            "the range answers are held to; use a string pattern for larger numbers"
        )
    return _compiled(
        lambda: llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(ANY_OBJECT if schema is None else schema),
            # json.dumps' spacing: the JSON models read most; no free whitespace, which a
            # small model may repeat until max_tokens
            defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
        )
    )


def call_grammar(schema: dict) -> str:
    """The grammar of a tool call's JSON body as a model writes it after its start marker:
    any leading whitespace, then JSON matching ``schema`` in the model's own spacing (it
    chose to write the call in its family's format, which its template spaces its way)."""
    import llguidance

    if bound := _integer_bound_past_64_bits(schema):
        raise UserError(f"a tool's parameters cannot be used: {bound} is past 64 bits")
    lark = "start: /[ \\t\\n]*/ %json " + json.dumps(schema)
    return _compiled(lambda: llguidance.LLMatcher.grammar_from_lark(lark))


def _compiled(make) -> str:
    """``make()``'s grammar, checked by llguidance; a failure is a one-line UserError."""
    import llguidance

    try:
        grammar = make()
    except RecursionError:
        raise UserError("the JSON schema cannot be used: it is nested too deeply") from None
    except (ValueError, RuntimeError, TypeError) as e:
        raise UserError(f"the JSON schema cannot be used: {_one_line(e)}") from None
    why = llguidance.LLMatcher.validate_grammar(grammar)
    if why and not why.startswith("WARNING"):
        raise UserError(f"the JSON schema cannot be used: {_one_line(why)}")
    return grammar


def _integer_bound_past_64_bits(schema) -> str | None:
    """An integer schema's bound that llguidance would clamp to 64 bits ("minimum 1e19"
    let 2**63 - 1 through), as ``name value``; None when there is none."""
    stack, seen = [schema], 0
    while stack and seen < 100_000:  # a request body's schema: bounded either way
        node, seen = stack.pop(), seen + 1
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            types = node.get("type")
            if types == "integer" or (isinstance(types, list) and "integer" in types):
                for name in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                    v = node.get(name)
                    ok = isinstance(v, bool) or not isinstance(v, int | float)
                    if not ok and not -(2**63) <= v < 2**63:
                        return f"{name} {v}"
            stack.extend(node.values())
    return None


def _one_line(e) -> str:
    """An error of llguidance's (a caret drawing over several lines) as one line, without
    the parser state it may append."""
    text = " ".join(str(e).split()).split(" <state>")[0]
    return text[:300] if text else type(e).__name__


def guidance_tokenizer(tokenizer):
    """llguidance's view of a model's tokenizer (built once per tokenizer: ~0.6 s)."""
    with _lock:
        found = _tokenizers.get(id(tokenizer))
        if found is None:
            import llguidance.hf

            hf = getattr(tokenizer, "_tokenizer", tokenizer)
            try:
                found = llguidance.hf.from_tokenizer(hf, eos_token=sorted(tokenizer.eos_token_ids))
            except ValueError as e:  # a slow (Python) tokenizer
                raise UserError(
                    f"this model's tokenizer cannot hold an answer to a grammar: {_one_line(e)}"
                ) from None
            _tokenizers[id(tokenizer)] = found
        return found


class GrammarProcessor:
    """A logits processor (as mlx-lm's: called with the tokens seen and the logits) that
    lets only the tokens the grammar allows next; it reads each answer token from the
    history it is shown, the first call's history being the prompt's."""

    stateful = True  # it keeps what it has read: drafts it is shown are rolled back

    def __init__(self, grammar: str, tokenizer):
        import llguidance

        # log_level 0: its errors come back through get_error(), not printed on stderr
        self.matcher = llguidance.LLMatcher(guidance_tokenizer(tokenizer), grammar, log_level=0)
        if self.matcher.is_error():
            raise UserError(f"the grammar cannot be used: {_one_line(self.matcher.get_error())}")
        self.started = False
        self.ends = frozenset(tokenizer.eos_token_ids)

    def __call__(self, history, logits):
        if self.started:
            self.consume(int(history[-1].item()))
        first = not self.started
        self.started = True
        return self.mask(logits, first)

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            self._failed()

    def drafts(self, pending: int, guess, most: int) -> list[int]:
        """Up to ``most`` tokens a draft step checks after ``pending`` (sampled under this
        grammar, not read yet): those the grammar forces there (a schema's keys and
        punctuation: jump-forward decoding), then the conversation's guesses after them
        (``guess(tokens, n)``: at most n tokens guessed to follow ``pending`` and
        ``tokens``), cut at the first the grammar does not allow. Leaves the grammar as it
        found it. No end-of-sequence token is read or drafted: llguidance cannot take one
        back (its rollback skips it)."""
        if pending in self.ends:
            return []
        if not self.matcher.consume_token(pending):
            self._failed()
        forced = self._before_end(self.matcher.compute_ff_tokens()[:most])
        forced = forced[: self.matcher.try_consume_tokens(forced)]
        read = 1 + len(forced)
        guessed = guess(tuple(forced), most - len(forced)) if len(forced) < most else []
        guessed = self._before_end(guessed[: self.matcher.validate_tokens(guessed)])
        self.matcher.rollback(read)
        return forced + guessed

    def _before_end(self, tokens: list[int]) -> list[int]:
        return tokens[: next((i for i, t in enumerate(tokens) if t in self.ends), len(tokens))]

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` tokens read (drafts the model did not keep)."""
        if n and not self.matcher.rollback(n):
            self._failed()

    def mask(self, logits, first: bool = False):
        """``logits`` with every token the grammar does not allow next at -inf."""
        import mlx.core as mx
        import numpy as np

        vocab = logits.shape[-1]
        mask = self.matcher.compute_bitmask()
        if self.matcher.is_error() and first:  # {"$ref": "#"}: not one token starts an answer
            raise UserError(
                "the JSON schema admits no answer the model can write: "
                f"{_one_line(self.matcher.get_error())}"
            )
        if self.matcher.is_error():
            self._failed()
        bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
        allowed = np.zeros(vocab, dtype=bool)
        n = min(vocab, bits.size)
        allowed[:n] = bits[:n].astype(bool)
        return mx.where(mx.array(allowed), logits, mx.array(-mx.inf, dtype=logits.dtype))

    def _failed(self):
        # llguidance's limits (a schema that recurses into itself, say) end the answer
        raise UserError(
            f"the answer could not follow its JSON schema: {_one_line(self.matcher.get_error())}"
        )


class TriggeredGrammar:
    """A logits processor that holds only what follows a trigger to a grammar: the model
    writes freely until the tokens it has seen end with ``trigger`` (a tool call's start
    marker), then only what ``grammar`` allows until it is complete, then freely again
    (the call's end marker, text, another call). llama.cpp's lazy grammars do the same.
    Each call reads one token (the history's last) and logs what it changed, so that the
    drafts a step showed it and the model did not keep can be rolled back."""

    stateful = True  # it keeps what it has read: drafts it is shown are rolled back

    def __init__(self, trigger: list[int], grammar: str, tokenizer):
        self.trigger = trigger
        self.grammar = grammar
        self.tokenizer = tokenizer
        self.held: GrammarProcessor | None = None  # the call being written
        self.tail: list[int] = []  # the last len(trigger) tokens seen, once written freely
        # per token read: (the call that read it, or None; the call and tail before it)
        self._log: deque = deque(maxlen=256)

    def __call__(self, history, logits):
        before, read = (self.held, self.tail), None
        if self.held is not None:
            read = self.held
            self.held.consume(int(history[-1].item()))
            if not self.held.matcher.is_accepting():
                self._log.append((read, *before))
                return self.held.mask(logits)
            self.held = None  # the call is whole
        k = len(self.trigger)
        self.tail = history[-k:].tolist() if k else []
        self._log.append((read, *before))
        if k and self.tail == self.trigger:
            self.held = GrammarProcessor(self.grammar, self.tokenizer)
            return self.held.mask(logits, first=True)
        return logits

    def drafts(self, pending: int, guess, most: int) -> list[int]:
        """As :meth:`GrammarProcessor.drafts` inside a call; writing freely, the guesses up
        to and with a trigger they complete (what follows it is the call's grammar's, which
        has not seen them), none where ``pending`` completes it."""
        if self.held is not None:
            return self.held.drafts(pending, guess, most)
        k = len(self.trigger)
        seen = [*self.tail, pending]
        if k and seen[-k:] == self.trigger:
            return []
        out = []
        for t in guess((), most):
            out.append(t)
            seen.append(t)
            if k and seen[-k:] == self.trigger:
                break
        return out

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` tokens read (drafts the model did not keep)."""
        for _ in range(n):
            read, self.held, self.tail = self._log.pop()
            if read is not None:
                read.rollback(1)
