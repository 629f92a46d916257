"""The engine's prefill on the default model: the prompt's last chunk gives the first
answer token (logits of its last position only), with mlx-lm's greedy tokens."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate

from mlxkv.caches import make_caches
from mlxkv.engine.events import TokenDelta
from mlxkv.engine.session import GenerationSettings, Session, encode_prompt
from mlxkv.models.head import head_split, last_logits
from mlxkv.policy import KVPolicy

pytestmark = pytest.mark.model

TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife. However little known the feelings or views of such "
    "a man may be on his first entering a neighbourhood, this truth is so well fixed in the "
    "minds of the surrounding families, that he is considered the rightful property of some "
    "one or other of their daughters."
)


def chat_prompt(loaded) -> str:
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    return loaded.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_last_logits_are_the_models_last_position(default_model):
    model = default_model.model
    assert head_split(model)  # llama: the head runs on the last position alone
    ids = mx.array(encode_prompt(default_model.tokenizer, TEXT))[None]
    whole = model(ids, cache=make_caches(model, KVPolicy()))[:, -1:, :]
    last = last_logits(model, ids, make_caches(model, KVPolicy()))
    assert last.shape == whole.shape == (1, 1, model.args.vocab_size)
    assert mx.allclose(last, whole, atol=1e-4, rtol=1e-4).item()
    assert mx.argmax(last).item() == mx.argmax(whole).item()


@pytest.mark.parametrize("step", [pytest.param(512, marks=pytest.mark.slow), 16])  # 16: more chunks
def test_greedy_tokens_are_mlx_lms(default_model, step):
    """Whole prompt in one chunk (512) or many (16): the tokens of mlx-lm's stream_generate,
    which feeds the prompt's last token in a call of its own."""
    gen = Session(default_model)
    for prompt in (chat_prompt(default_model), TEXT):
        ours = [
            ev.token
            for ev in gen.run(prompt, GenerationSettings(max_tokens=12, prefill_step=step))
            if isinstance(ev, TokenDelta) and ev.token >= 0
        ]
        ids = encode_prompt(default_model.tokenizer, prompt)
        ref = [
            r.token
            for r in stream_generate(
                default_model.model,
                default_model.tokenizer,
                mx.array(ids),
                max_tokens=12,
                prefill_step_size=step,
            )
        ]
        assert ours == ref[: len(ours)] and len(ours) >= 6


def test_the_first_token_costs_no_model_call_of_its_own(default_model, monkeypatch):
    """A short prompt is one model call that ends with the first token; one more feeds that
    token to the cache (the cache holds every generated token)."""
    body = type(default_model.model.model)
    calls = []
    call = body.__call__

    def counted(self, x, *args, **kwargs):
        calls.append(x.shape[1])
        return call(self, x, *args, **kwargs)

    monkeypatch.setattr(body, "__call__", counted)
    gen = Session(default_model)
    ids = encode_prompt(default_model.tokenizer, chat_prompt(default_model))
    out = list(gen.run_tokens(ids, GenerationSettings(max_tokens=1)))
    assert calls == [len(ids), 1]
    assert out[-1].stats.kv_tokens_seen == len(ids) + 1 == len(gen.tokens)
