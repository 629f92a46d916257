"""Constrained decoding on the default model: an answer held to a JSON schema is the
tokens of mlx-lm's own generate_step with llguidance's mask applied by llguidance's own
numpy helpers (the reference), alone and in a batch beside a free answer; and it parses."""

from __future__ import annotations

import json

import pytest

from mlxkv.engine.events import Failed, Finished, TokenDelta
from mlxkv.engine.grammar import json_grammar
from mlxkv.engine.scheduler import Request, Scheduler
from mlxkv.engine.session import GenerationSettings
from mlxkv.errors import UserError
from mlxkv.policy import KVPolicy
from tests.mlx_lm_ref import greedy_tokens

pytestmark = pytest.mark.model

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "enum": ["France", "Germany", "Italy"]},
        "is_capital": {"type": "boolean"},
    },
    "required": ["city", "country", "is_capital"],
    "additionalProperties": False,
}
ASK = "What is the capital of France? Answer in JSON."


def _ids(loaded, q: str) -> list[int]:
    text = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
    )
    return Scheduler(loaded).encode(text)


def reference_mask(tokenizer, grammar: str):
    """llguidance's matcher and numpy helpers as a logits processor for mlx-lm."""
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lln
    import mlx.core as mx
    import numpy as np

    matcher = llguidance.LLMatcher(
        llguidance.hf.from_tokenizer(
            tokenizer._tokenizer, eos_token=sorted(tokenizer.eos_token_ids)
        ),
        grammar,
    )
    seen = []

    def process(tokens, logits):
        if seen:
            assert matcher.consume_token(int(tokens[-1].item()))
        seen.append(tokens.size)
        out = np.array(logits.astype(mx.float32))
        mask = lln.allocate_token_bitmask(1, out.shape[-1])
        lln.fill_next_token_bitmask(matcher, mask)
        lln.apply_token_bitmask_inplace(out, mask)
        return mx.array(out)

    return process


def _tokens(handle) -> tuple[list[int], list]:
    events = list(handle.events())
    return [e.token for e in events if isinstance(e, TokenDelta) and e.token >= 0], events


def test_a_schema_answer_is_the_reference_alone_and_in_a_batch(default_model):
    tok = default_model.tokenizer
    ids = _ids(default_model, ASK)
    free_ids = _ids(default_model, "Name three colours.")
    n, n_free = 48, 12  # the free row shares the first 12 steps with the held one
    grammar = json_grammar(SCHEMA)
    ref = greedy_tokens(default_model, ids, n, [reference_mask(tok, grammar)], tok.eos_token_ids)
    free_ref = greedy_tokens(default_model, free_ids, n_free, [])

    sched = Scheduler(default_model, KVPolicy(), max_batch=4)
    held = sched.submit(Request(ids, GenerationSettings(max_tokens=n, grammar=grammar)))
    free = sched.submit(Request(free_ids, GenerationSettings(max_tokens=n_free)))
    while sched.step():
        pass
    assert sched.status()["max_rows_in_a_step"] == 2
    got, events = _tokens(held)
    free_got, _ = _tokens(free)
    end = next(i for i, t in enumerate(ref) if t in tok.eos_token_ids)  # mlx-lm goes on
    assert got == ref[:end]
    assert free_got == free_ref[: len(free_got)] and free_got != got
    (done,) = [e for e in events if isinstance(e, Finished)]
    assert done.finish_reason == "stop"
    answer = json.loads(done.text)
    assert set(answer) == {"city", "country", "is_capital"}
    assert answer["country"] in ("France", "Germany", "Italy")
    assert isinstance(answer["is_capital"], bool) and len(answer["city"]) <= 24
    assert done.text == tok.decode(got)


def test_a_grammar_that_breaks_mid_answer_fails_its_row_alone(default_model):
    """A schema that recurses into itself passes llguidance's checks and then meets its
    parser's limit a token into the answer: that row fails (one line, no parser state
    dump), and the row batched beside it goes on to the same tokens as alone (it failed
    with it before)."""
    ids = _ids(default_model, ASK)
    free_ids = _ids(default_model, "Name three colours.")
    selfish = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    free_ref = greedy_tokens(default_model, free_ids, 12, [])

    sched = Scheduler(default_model, KVPolicy(), max_batch=4)
    settings = GenerationSettings(max_tokens=40, grammar=json_grammar(selfish))
    broken = sched.submit(Request(ids, settings))
    free = sched.submit(Request(free_ids, GenerationSettings(max_tokens=12)))
    while sched.step():
        pass
    assert sched.status()["max_rows_in_a_step"] == 2
    failed = list(broken.events())[-1]
    assert isinstance(failed, Failed) and failed.code == "invalid_grammar", failed
    assert failed.message == (
        "the answer could not follow its JSON schema: parser error: Too many items (limit "
        "50000; ff_tokens); try avoiding single-byte/short lexemes"
    )
    assert _tokens(free)[0] == free_ref


def test_a_schema_that_admits_no_answer_fails_before_its_first_token(default_model):
    """{"$ref": "#"} compiles, then no token can start it: it was an empty answer, "stop"."""
    sched = Scheduler(default_model, KVPolicy())
    ids = _ids(default_model, ASK)
    h = sched.submit(
        Request(ids, GenerationSettings(max_tokens=8, grammar=json_grammar({"$ref": "#"})))
    )
    while sched.step():
        pass
    events = list(h.events())
    assert not [e for e in events if isinstance(e, TokenDelta | Finished)]
    failed = events[-1]
    assert isinstance(failed, Failed) and failed.code == "invalid_grammar"
    assert failed.message == "the JSON schema admits no answer the model can write: NoExtensionBias"


def test_any_json_object_and_a_grammar_that_cannot_be_used(default_model):
    sched = Scheduler(default_model, KVPolicy(), max_batch=4)
    ids = _ids(default_model, ASK)
    obj = sched.submit(Request(ids, GenerationSettings(max_tokens=64, grammar=json_grammar(None))))
    broken = sched.submit(Request(ids, GenerationSettings(max_tokens=8, grammar="not a grammar")))
    while sched.step():
        pass
    _, events = _tokens(obj)
    text = events[-1].text
    assert text.startswith("{")
    if events[-1].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    (failed,) = list(broken.events())
    assert isinstance(failed, Failed) and failed.code == "invalid_grammar"
    assert failed.message.startswith("the grammar cannot be used: ")
    assert "\n" not in failed.message


def test_a_schema_that_cannot_be_used_is_one_line():
    """Unresolvable, too deep (for Python's encoder or for llguidance) or too large: a
    one-line UserError (the server's 400), never a crash or a long compile."""
    cases = {
        "unresolvable": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}},
        "nested too deeply": _nested(900),  # a request body may hold it: json.loads takes it
        "recursion limit exceeded": _nested(150),  # llguidance's own limit
        "schema too large": {"anyOf": [{"pattern": f"x{i}[a-z]{{3,9}}"} for i in range(20000)]},
    }
    for words, schema in cases.items():
        with pytest.raises(UserError) as e:
            json_grammar(schema)
        message = str(e.value)
        assert message.startswith("the JSON schema cannot be used: ") and "\n" not in message
        if words != "unresolvable":
            assert words in message, message


@pytest.mark.parametrize(
    "schema, bound",
    [
        ({"type": "integer", "minimum": 10**19, "maximum": 10**20}, "minimum 10000000000000000000"),
        ({"type": "integer", "minimum": 1e300}, "minimum 1e+300"),
        (
            {
                "type": "object",
                "properties": {"n": {"type": ["integer", "null"], "maximum": -(2**64)}},
            },
            "maximum -18446744073709551616",
        ),
    ],
)
def test_integer_bounds_past_64_bits_are_refused(schema, bound):
    """llguidance holds integers to 64 bits: minimum 1e19 let 9223372036854775807 through,
    an answer below its own minimum. Bounds inside the range compile."""
    with pytest.raises(UserError) as e:
        json_grammar(schema)
    assert str(e.value) == (
        f"the JSON schema cannot be used: {bound} is past what a 64-bit integer holds, the "
        "range answers are held to; use a string pattern for larger numbers"
    )
    assert json_grammar({"type": "integer", "minimum": 2**62, "maximum": 2**63 - 1})


def _nested(depth: int) -> dict:
    s = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}}
    return s


@pytest.mark.slow  # (the fast suite holds strict calls through the server, test_serve_tools)
def test_a_triggered_grammar_holds_only_what_follows_its_trigger(default_model):
    """A tool call's grammar (``call_grammar``) held by ``TriggeredGrammar``: the answer is
    the free answer up to the trigger (here "```json", where the model opens its JSON),
    then the reference's held tokens until the JSON is whole, then free again (the
    reference: mlx-lm's generate_step over each piece, llguidance's own mask between)."""
    import llguidance

    from mlxkv.engine.grammar import TriggeredGrammar, call_grammar, guidance_tokenizer

    tok = default_model.tokenizer
    ids = _ids(default_model, "Give the capital of France as a JSON object in a ```json block.")
    trigger = tok.encode("```json", add_special_tokens=False)
    grammar = call_grammar(SCHEMA)
    free = greedy_tokens(default_model, ids, 40, [], tok.eos_token_ids)
    k = next(i + 1 for i in range(len(free)) if free[: i + 1][-len(trigger) :] == trigger)
    held = greedy_tokens(default_model, ids + free[:k], 40, [reference_mask(tok, grammar)])
    matcher = llguidance.LLMatcher(guidance_tokenizer(tok), grammar, log_level=0)
    j = next(
        i + 1 for i, t in enumerate(held) if matcher.consume_token(t) and matcher.is_accepting()
    )
    after = greedy_tokens(default_model, ids + free[:k] + held[:j], 8, [])
    want = free[:k] + held[:j] + after

    got = greedy_tokens(default_model, ids, len(want), [TriggeredGrammar(trigger, grammar, tok)])
    assert got == want
    answer = json.loads(tok.decode(held[:j]))
    assert set(answer) == {"city", "country", "is_capital"}
    assert free[k:] != held[: len(free) - k]  # the model's own JSON broke the schema


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "birth_year": {"type": "integer"},
        "known_for": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "birth_year", "known_for"],
    "additionalProperties": False,
}


def test_a_grammar_drafts_what_it_forces_then_the_guesses_it_allows(default_model):
    """After a pending token the grammar drafts what it forces there (a key and its
    punctuation), then the conversation's guesses after those, cut at the first it does not
    allow; never an end-of-sequence token (llguidance cannot take one back); and it reads
    nothing."""
    from mlxkv.engine.grammar import GrammarProcessor

    tok = default_model.tokenizer

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    asked = []

    def guess(text: str):
        def after(tokens, n):
            asked.append((tok.decode(list(tokens)), n))
            return enc(text)[:n]

        return after

    grammar = GrammarProcessor(json_grammar(PERSON), tok)
    for t in enc('{"name": "Ada Lovelace",'):
        grammar.consume(t)
    before = grammar.matcher.compute_bitmask()
    (space_quote,) = enc(' "')
    assert tok.decode(grammar.drafts(space_quote, guess(""), 8)) == 'birth_year":'
    assert tok.decode(grammar.drafts(space_quote, guess(" 1815,"), 8)) == 'birth_year": 181'
    assert asked[-1] == ('birth_year":', 4)  # guesses after the 4 forced tokens, 8 in all
    assert tok.decode(grammar.drafts(space_quote, guess(" 1815,"), 12)) == 'birth_year": 1815,'
    assert tok.decode(grammar.drafts(space_quote, guess(' "1815"'), 8)) == 'birth_year":'
    assert tok.decode(grammar.drafts(space_quote, guess(" 1815"), 2)) == "birth_"
    assert grammar.matcher.compute_bitmask() == before  # nothing read

    for t in enc(' "birth_year": '):
        grammar.consume(t)
    (one,) = enc("1")
    digits = grammar.drafts(one, lambda after, n: enc("815") + enc("abc"), 8)
    assert digits == enc("815") and asked[-1][0] == 'birth_year":'  # nothing forced: no call
    for t in enc('1815, "known_for": ["the first program"]'):
        grammar.consume(t)
    eos = sorted(tok.eos_token_ids)[0]
    (close,) = enc("}")
    assert grammar.drafts(close, lambda after, n: [eos], 8) == []  # whole: only EOS is left
    assert grammar.drafts(eos, guess(" x"), 8) == []
    grammar.consume(close)
    grammar.consume(eos)  # still allowed: the EOS drafts() saw was never read
    assert grammar.matcher.is_stopped() and not grammar.matcher.is_error()


@pytest.mark.parametrize(
    "question,schema,rejected,n",
    [
        pytest.param(ASK, SCHEMA, False, 24, id="city"),
        # (in the fast suite a strict tool call's grammar rolls back rejected drafts:
        # tests/test_serve_tools.py)
        pytest.param(
            "Describe Ada Lovelace as JSON.", PERSON, True, 52, id="person", marks=pytest.mark.slow
        ),
    ],
)
def test_a_drafted_schema_answer_is_the_reference_to_its_end(
    default_model, question, schema, rejected, n
):
    """With drafts, an answer held to a schema checks its forced tokens and the guesses the
    grammar allows several a step, and the grammar forgets the drafts the model did not
    keep (the person's answer has some): the answer is the reference token for token, its
    EOS included."""
    tok = default_model.tokenizer
    ids = _ids(default_model, question)
    grammar = json_grammar(schema)
    ref = greedy_tokens(default_model, ids, n, [reference_mask(tok, grammar)], tok.eos_token_ids)
    sched = Scheduler(default_model, KVPolicy(), draft_tokens=8)
    got, events = _tokens(sched.submit(Request(ids, GenerationSettings(grammar=grammar))))
    end = next(i for i, t in enumerate(ref) if t in tok.eos_token_ids)
    assert got == ref[:end]
    assert events[-1].finish_reason == "stop" and set(json.loads(events[-1].text)) == set(
        schema["required"]
    )
    assert sched.accepted >= 4 and (sched.drafted > sched.accepted) == rejected


def test_a_sampled_schema_answer_keeps_every_forced_draft(default_model):
    """A sampled answer keeps a draft with its sampler's probability of it: a forced token
    is the only one the mask leaves, so every one is kept, and the answer still parses."""
    import mlx.core as mx

    mx.random.seed(3)
    tok = default_model.tokenizer
    settings = GenerationSettings(temperature=0.9, grammar=json_grammar(SCHEMA))
    sched = Scheduler(default_model, KVPolicy(), draft_tokens=8)
    got, events = _tokens(sched.submit(Request(_ids(default_model, ASK), settings)))
    assert events[-1].finish_reason == "stop", events[-1]
    assert set(json.loads(events[-1].text)) == set(SCHEMA["required"])
    assert tok.decode(got) == events[-1].text
    assert sched.accepted >= 6  # '", "country": "' and '", "is_capital": '
