"""Chat templates are untrusted code: sandboxed, bounded in time and size, one-line errors."""

from __future__ import annotations

import json
import time

import pytest

from mlxkv.errors import UserError
from mlxkv.models import chat_template
from mlxkv.models.chat_template import render
from tests.bad_input import refused, snapshot

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(autouse=True)
def _short_limit(monkeypatch):
    monkeypatch.setattr(chat_template, "TIME_LIMIT", 1.0)


@pytest.mark.parametrize(
    "source, words",
    [
        ("{% include 'secret.txt' %}", "it includes 'secret.txt'; a chat template may not read"),
        ("{% import '/etc/passwd' as p %}", "it includes '/etc/passwd'"),
        ("{{ raise_exception('Only user and assistant roles') }}", "Only user and assistant roles"),
        ("{% for m in messages %}", "it does not parse (line 1:"),
        ("{{ messages.__class__.__mro__ }}", "failed"),
        (
            "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
            "it ran longer than 1 s",
        ),  # fmt: skip
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "it recurses too deeply"),
        ("{{ 'x' * 10**10 }}", "it repeats a value 10000000000 times"),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
            "{% endfor %}{{ ns.s }}",
            "it builds a string longer than",
        ),  # fmt: skip
        ("{% for i in range(99999) %}{{ 'y' * 1000 }}{% endfor %}", "its output is longer than"),
        ("{{ 'x'|center(10**9) }}", "it passes the number 1000000000"),
        ("{{ ('x' * 1000000)|replace('x', 'y' * 1000) }}", "it builds a string longer than"),
        ("{{ ('x' * 1000000).replace('x', 'y' * 1000) }}", "it builds a string longer than"),
        ("{{ '{:>1000000000}'.format(1) }}", "a width of a million or more"),
        ("{{ '%1000000000s' % 1 }}", "a width of a million or more"),
        ("{{ ('\\n' * 1000000)|indent(99999) }}", "it builds a string longer than"),
        ("{{ ','.join(['x' * 1000000] * 1000) }}", "it writes out a value of more than"),
        # one big list held many times: nothing to build, gigabytes to write out (it took
        # 84 s and 4.8 GB before the time limit could stop the C code writing it)
        ("{% set a = [0] * 1000000 %}{{ [a] * 3000 }}", "it writes out a value of more than"),
        ("{% set a = [0] * 1000000 %}{{ ([a] * 300)|tojson }}", "it writes out a value of"),
        ("{% set a = [0] * 100000 %}{{ ([a] * 400)|sum(start=[]) }}", "it writes out a value"),
        ("{% set a = [0] * 1000000 %}{{ '{}'.format([a] * 300) }}", "it writes out a value"),
        ("{% set a = [0] * 1000000 %}{{ 'x' ~ [a] * 300 }}", "it writes out a value of"),
        (
            "{% set ns = namespace(x=10) %}{% for i in range(64) %}{% set ns.x = ns.x ** 2 %}"
            "{% endfor %}{{ ns.x }}",
            "it raises a number to the power 2",
        ),  # fmt: skip
        (
            "{% set ns = namespace(x=10) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}"
            "{% endfor %}{{ ns.x }}",
            "it multiplies numbers too large",
        ),  # fmt: skip
    ],
)
def test_hostile_template_is_one_line_and_bounded(source, words):
    t = time.monotonic()
    with pytest.raises(UserError) as e:
        render(source, messages=MESSAGES, add_generation_prompt=True)
    message = str(e.value)
    assert message.startswith("the model's chat template failed: ") and "\n" not in message
    assert words in message, message
    assert time.monotonic() - t < 30  # generous: the limit is 1 s; no loop runs to its end


def test_ordinary_templates_render_as_transformers_does(default_model_path):
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(default_model_path)
    turns = [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "é"}]
    chats = [MESSAGES, [{"role": "system", "content": "S"}, *MESSAGES, *turns]]
    ref = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=g)
           for c in chats for g in (True, False)]  # fmt: skip
    chat_template.install(tok)
    assert tok._tokenizer.apply_chat_template.mlxkv_bounded
    got = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=g)
           for c in chats for g in (True, False)]  # fmt: skip
    assert got == ref


@pytest.mark.parametrize("start", ["1, 2, 3,", "The answer is ", "  two spaces"])
def test_a_final_message_is_continued_as_transformers_does(default_model_path, start):
    """continue_final_message (a prefill): the prompt ends right after the assistant's own
    start of its answer, cut as transformers cuts it, trailing spaces included or not."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(default_model_path)
    chat = [*MESSAGES, {"role": "assistant", "content": start}]
    kw = {"add_generation_prompt": False, "continue_final_message": True}
    ref = tok.apply_chat_template(chat, tokenize=False, **kw)
    ref_ids = tok.apply_chat_template(chat, tokenize=True, **kw)
    chat_template.install(tok)
    assert tok.apply_chat_template(chat, tokenize=False, **kw) == ref
    assert tok.apply_chat_template(chat, tokenize=True, **kw) == ref_ids
    assert ref.endswith(start.lstrip())  # this template keeps trailing spaces


def test_a_final_message_the_template_hides_is_refused():
    from mlxkv.models.chat_template import open_final_message

    chat = [*MESSAGES, {"role": "assistant", "content": "hidden"}]
    with pytest.raises(UserError) as e:
        open_final_message("<user>Hi</user>", chat)
    assert str(e.value) == (
        "the last message cannot be continued: the chat template does not show its text as written"
    )


def _folder_with_template(src, dst, template: str):
    """The default model with its chat template replaced (weights linked, not copied)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f)
        elif f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "template, words",
    [
        (
            "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
            "it ran longer than 1 s",
        ),  # fmt: skip
    ],
)
def test_model_folder_template_through_generate(
    capsys, tmp_path, monkeypatch, default_model_path, template, words
):
    monkeypatch.setenv("MLXKV_HOME", str(tmp_path / "home"))
    folder = _folder_with_template(default_model_path, tmp_path / "m", template)
    before = snapshot(folder)
    line = refused(capsys, "generate", "--model", str(folder), "-p", "hi", "--max-tokens", "2")
    assert "the model's chat template failed: " + words in line
    assert snapshot(folder) == before


def test_gguf_template_through_generate(capsys, tmp_path, monkeypatch):
    """A GGUF's tokenizer.chat_template that never ends: the crafted tiny llama converts and
    loads, then its template is stopped at the limit."""
    from tests.gguf_files import STR, base_meta, base_tensors, gguf

    monkeypatch.setenv("MLXKV_HOME", str(tmp_path / "home"))
    meta = base_meta()
    meta["tokenizer.chat_template"] = (STR, "{% for i in range(99999) %}{% for j in range(99999) %}"
                                       "{% endfor %}{% endfor %}")  # fmt: skip
    f = tmp_path / "loop.gguf"
    f.write_bytes(gguf(meta, base_tensors()))
    line = refused(capsys, "generate", "--model", str(f), "-p", "hi", "--max-tokens", "2")
    assert "the model's chat template failed: it ran longer than 1 s" in line
