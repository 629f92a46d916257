"""Fill-in-the-middle: each code family's format found from its tokenizer's markers, the
prompt laid out as the family was trained, and a completion between a prefix and a
suffix through ``mlxkv serve`` (OpenAI's ``suffix`` and Ollama's), on a real model that
writes a given middle."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from mlxkv.models.fim import FORMATS, fim_format
from tests.serve_helpers import serving
from tests.tiny_models import scripted_model

BEFORE = "def add(a, b):\n    "
AFTER = "\n\nprint(add(1, 2))"
MIDDLE = "return a + b"


def tokenizer_with(folder, added: tuple[str, ...]):
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.add_tokens(list(added))
    return tok


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
def test_each_family_is_found_by_its_markers(default_model_path, fmt):
    tok = tokenizer_with(default_model_path, (fmt.prefix, fmt.suffix, fmt.middle))
    assert fim_format(tok) == fmt


def test_a_model_without_markers_has_no_format(default_model_path):
    assert fim_format(AutoTokenizer.from_pretrained(str(default_model_path))) is None
    half = tokenizer_with(default_model_path, ("<|fim_prefix|>", "<|fim_suffix|>"))
    assert fim_format(half) is None


def test_the_prompt_is_laid_out_as_each_family_was_trained():
    qwen, starcoder, deepseek, codestral = FORMATS
    assert qwen.prompt("a", "b") == "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>"
    assert starcoder.prompt("a", "b") == "<fim_prefix>a<fim_suffix>b<fim_middle>"
    assert deepseek.prompt("a", "b") == "<｜fim▁begin｜>a<｜fim▁hole｜>b<｜fim▁end｜>"
    assert codestral.prompt("a", "b") == "[SUFFIX]b[PREFIX]a"  # suffix first
    assert "<|file_sep|>" in qwen.stops and "<fim_middle>" in starcoder.stops


# -- through the server ---------------------------------------------------------------------
# A model whose "generation prompt" ends where a FIM prompt does, at <|fim_middle|>, so the
# scripted model writes its middle after it (then a file separator, which ends the middle).
FIM_MARKERS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>")
FIM_TEMPLATE = (
    "{% for m in messages %}{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|fim_middle|>{% endif %}"
)


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory, default_model_path):
    out = tmp_path_factory.mktemp("fim_model")
    scripted_model(out, default_model_path, f"{MIDDLE}<|file_sep|>more", FIM_TEMPLATE, FIM_MARKERS)
    return out


@pytest.fixture(scope="module")
def fim_server(tmp_path_factory, fim_model):
    yield from serving(tmp_path_factory.mktemp("serve_fim"), str(fim_model), "--force")


@pytest.mark.model
def test_openai_suffix_fills_the_middle(fim_server, fim_model):
    tok = AutoTokenizer.from_pretrained(str(fim_model))
    prompt = tok.encode(f"<|fim_prefix|>{BEFORE}<|fim_suffix|>{AFTER}<|fim_middle|>")
    r = fim_server.client().completions.create(
        model=fim_server.model, prompt=BEFORE, suffix=AFTER, max_tokens=32
    )
    assert r.choices[0].text == MIDDLE
    assert r.choices[0].finish_reason == "stop"  # at the file separator the model wrote
    assert r.usage.prompt_tokens == len(prompt)


@pytest.mark.model
def test_a_file_start_is_an_empty_prompt_before_the_suffix(fim_server, fim_model):
    tok = AutoTokenizer.from_pretrained(str(fim_model))
    prompt = tok.encode(f"<|fim_prefix|><|fim_suffix|>{AFTER}<|fim_middle|>")
    r = fim_server.client().completions.create(
        model=fim_server.model, prompt="", suffix=AFTER, max_tokens=32
    )
    assert (r.choices[0].text, r.usage.prompt_tokens) == (MIDDLE, len(prompt))
    body = {"model": fim_server.model, "prompt": "", "suffix": AFTER, "stream": False}
    r = fim_server.http("POST", "/api/generate", json=body).json()
    assert (r["response"], r["prompt_eval_count"]) == (MIDDLE, len(prompt))


@pytest.mark.model
def test_ollama_suffix_fills_the_middle(fim_server):
    body = {"model": fim_server.model, "prompt": BEFORE, "suffix": AFTER, "stream": False}
    r = fim_server.http("POST", "/api/generate", json=body).json()
    assert (r["response"], r["done_reason"]) == (MIDDLE, "stop")
    shown = fim_server.http("POST", "/api/show", json={"model": fim_server.model}).json()
    assert "insert" in shown["capabilities"]


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    yield from serving(tmp_path_factory.mktemp("serve_no_fim"))


@pytest.mark.model
def test_a_model_without_fim_refuses_a_suffix(plain_server):
    r = plain_server.http(
        "POST",
        "/v1/completions",
        json={"model": "smollm2-135m", "prompt": BEFORE, "suffix": AFTER, "max_tokens": 4},
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("suffix", "fim_unsupported")
    assert err["message"].startswith(
        "suffix: the model 'smollm2-135m' has no fill-in-the-middle tokens"
    )
    body = {"model": "smollm2-135m", "prompt": BEFORE, "suffix": AFTER, "stream": False}
    r = plain_server.http("POST", "/api/generate", json=body)
    assert r.status_code == 400 and r.json()["error"] == err["message"]
    r = plain_server.http(
        "POST",
        "/v1/completions",
        json={"model": "smollm2-135m", "prompt": [1, 2], "suffix": AFTER, "max_tokens": 4},
    )
    assert r.json()["error"]["message"] == "suffix needs the prompt as text, not token ids"
