"""Fill-in-the-middle: each code family's format found from its tokenizer's markers, the
prompt laid out as the family was trained (and as llama.cpp's /infill lays it out), and a
completion between a prefix and a suffix through ``mlxkv serve`` (OpenAI's ``suffix``,
Ollama's, llama.cpp's /infill), on a real model that writes a given middle."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from mlxkv.models.fim import FORMATS, InfillText, fim_format, infill_ids, prefix_tail
from tests.serve_helpers import serving
from tests.tiny_models import scripted_model

BEFORE = "def add(a, b):\n    "
AFTER = "\n\nprint(add(1, 2))"
MIDDLE = "return a + b\n    x = 2\ny"  # its last line is less indented than the block


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


# -- llama.cpp's /infill ---------------------------------------------------------------------
QWEN_REPO = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>", "<|repo_name|>")


def test_infill_lays_out_files_prefix_line_and_suffix_as_llama_cpp(default_model_path):
    """The repository layout (the model has the repository markers): each file under its
    path, the cursor's file named "filename", the cursor's line after the prefix; without
    the markers the files are joined by snippet lines; Codestral's suffix comes first."""
    qwen, _, _, codestral = FORMATS
    tok = tokenizer_with(default_model_path, QWEN_REPO)
    text = InfillText("def f():\n", "\nprint(f())", "    ret", (("a.py", "x = 1\n"),))
    ids, cut = infill_ids(tok, qwen, True, text, 16, 8192)
    assert tok.decode(ids) == (
        "<|repo_name|>myproject\n<|file_sep|>a.py\nx = 1\n<|file_sep|>filename\n"
        "<|fim_prefix|>def f():\n    ret<|fim_suffix|>\nprint(f())<|fim_middle|>"
    )
    assert not cut
    ids, _ = infill_ids(tok, qwen, False, text, 16, 8192)
    assert tok.decode(ids) == (
        "\n\n--- snippet ---\n\nx = 1\n"
        "<|fim_prefix|>def f():\n    ret<|fim_suffix|>\nprint(f())<|fim_middle|>"
    )
    tok = tokenizer_with(default_model_path, ("[PREFIX]", "[SUFFIX]"))
    ids, _ = infill_ids(tok, codestral, False, InfillText("a", "b"), 16, 8192)
    assert tok.decode(ids) == "[SUFFIX]b[PREFIX]a"


def test_infill_keeps_llama_cpps_budgets(default_model_path):
    """The prefix's last 1,536 tokens (one line: nowhere else to start), the suffix's first
    510 less the cursor line's, and the files' last tokens that leave 2,048 and twice the
    answer free in the context."""
    qwen = FORMATS[0]
    tok = tokenizer_with(default_model_path, QWEN_REPO)
    a, b, c = (tok.encode(t, add_special_tokens=False) for t in (" a", " b", " c"))
    assert len(a) == len(b) == len(c) == 1
    text = InfillText(" a" * 2000, " b" * 600, " c" * 3, (("f", " c" * 50),))
    ids, cut = infill_ids(tok, qwen, False, text, 16, 2048 + 2 * 16 + 10)
    assert cut
    assert ids.count(a[0]) == 1536 and ids.count(b[0]) == 512 - 2 - 3
    assert ids[:10] == c * 10  # the files' last 10 tokens, then the prefix marker
    assert tok.decode(ids[10:11]) == "<|fim_prefix|>"
    whole, cut = infill_ids(tok, qwen, False, text, 16, None)
    assert cut and whole.count(c[0]) == 53  # no context: every file token (and the line's)


def code_lines(n: int, blank_every: int = 0) -> list[str]:
    """Lines of a made-up source file (about ten tokens each)."""
    return [
        "" if blank_every and i % blank_every == blank_every - 1 else f"    v{i} = w[{i}] * {i * 7}"
        for i in range(n)
    ]


@pytest.mark.parametrize("blank_every", [9, 0], ids=["blank lines", "no blank line"])
def test_the_prefix_keeps_its_start_as_the_cursor_moves_down(default_model_path, blank_every):
    """Over its budget, the prefix starts at a whole line chosen by content, not at its
    last 1,536 tokens: as the cursor moves down a line at a time (llama.vim's 256 lines
    before it), the kept prefix starts at the same line for many moves, so the next
    completion reuses it from the prefix cache; with blank lines it starts at one."""
    tok = AutoTokenizer.from_pretrained(str(default_model_path))

    def enc(t):
        return tok.encode(t, add_special_tokens=False)

    lines = code_lines(400, blank_every)
    starts = []
    for cursor in range(300, 320):
        text = "\n".join(lines[cursor - 256 : cursor]) + "\n"
        kept, cut = prefix_tail(enc, text, 1536)
        tail = tok.decode(kept)
        assert cut and 1024 <= len(kept) <= 1536 and text.endswith(tail)
        assert text[: len(text) - len(tail)].endswith("\n")  # a whole line
        starts.append(len(lines[:cursor]) - tail.count("\n"))  # the line it starts at
        if blank_every:
            assert lines[starts[-1]] == ""
    assert len(set(starts)) <= 3, starts  # llama.cpp's cut: a new start at every move
    one_line, cut = prefix_tail(enc, " a" * 2000, 1536)  # no line to start at
    assert cut and one_line == enc(" a" * 2000)[-1536:]


INFILL = {"input_prefix": BEFORE, "input_suffix": AFTER, "n_predict": 32, "temperature": 0}
LLAMA_VIM_FIELDS = [  # what llama.vim asks /infill to answer with
    "content",
    "timings/prompt_n",
    "timings/prompt_ms",
    "timings/prompt_per_token_ms",
    "timings/prompt_per_second",
    "timings/predicted_n",
    "timings/predicted_ms",
    "timings/predicted_per_token_ms",
    "timings/predicted_per_second",
    "truncated",
    "tokens_cached",
]


@pytest.mark.model
def test_infill_fills_the_middle_as_llama_cpp_answers(fim_server, fim_model):
    """/infill as llama.vim sends it: the middle the model wrote up to the format's file
    separator (an end of text: stop_type eos), the prompt as long as the OpenAI suffix
    path's, the fields asked for keyed by their paths; llama.vim's warm-up (n_predict 0,
    response_fields [""]) gets {} and leaves its files in the prefix cache."""
    tok = AutoTokenizer.from_pretrained(str(fim_model))
    prompt = tok.encode(f"<|fim_prefix|>{BEFORE}<|fim_suffix|>{AFTER}<|fim_middle|>")
    r = fim_server.http("POST", "/infill", json=INFILL)
    assert r.status_code == 200, r.text
    out = r.json()
    assert (out["content"], out["stop_type"], out["stopping_word"]) == (MIDDLE, "eos", "")
    assert out["stop"] is True and out["truncated"] is False and out["has_new_line"] is True
    assert out["tokens_evaluated"] == len(prompt)
    assert out["tokens_predicted"] == out["timings"]["predicted_n"] > 0
    assert out["tokens_cached"] == out["tokens_evaluated"] + out["tokens_predicted"]
    out = fim_server.http("POST", "/infill", json={**INFILL, "stop": [" +", "zz"]}).json()
    assert (out["content"], out["stop_type"], out["stopping_word"]) == ("return a", "word", " +")

    files = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]
    warm = {**INFILL, "input_prefix": "", "input_suffix": "", "input_extra": files}
    warm |= {"n_predict": 0, "response_fields": [""], "samplers": [], "cache_prompt": True}
    r = fim_server.http("POST", "/infill", json=warm)
    assert (r.status_code, r.json()) == (200, {})
    ask = {**INFILL, "input_extra": files, "response_fields": LLAMA_VIM_FIELDS, "id_slot": 0}
    ask |= {"samplers": ["top_k", "top_p", "infill"], "top_k": 40, "top_p": 0.9}
    out = fim_server.http("POST", "/infill", json=ask).json()
    assert set(out) == set(LLAMA_VIM_FIELDS) and out["content"] == MIDDLE
    # each part tokenized alone, as llama.cpp tokenizes them
    snippet = tok.encode("\n\n--- snippet ---\n\n") + tok.encode(files[0]["text"])
    assert out["tokens_cached"] == len(snippet) + len(prompt) + out["timings/predicted_n"]
    assert out["timings/prompt_n"] < len(prompt)  # the files came from the warm-up's prefix


@pytest.mark.model
def test_infill_moving_down_a_line_prefills_little_more_than_the_suffix(fim_server):
    """llama.vim's prefix is the 256 lines before the cursor, over the 1,536-token budget
    here: one line further down, the completion reuses the prefix from the prefix cache
    (its start stayed put) and prefills the new line, the cursor's and the suffix."""
    lines = code_lines(400, 9)
    outs = []
    for cursor in (300, 301):
        body = {
            "input_prefix": "\n".join(lines[cursor - 256 : cursor]) + "\n",
            "prompt": "    v",
            "input_suffix": "\n".join(lines[cursor + 1 : cursor + 4]),
            "n_predict": 4,
        }
        r = fim_server.http("POST", "/infill", json=body)
        assert r.status_code == 200, r.text
        outs.append(r.json())
    first, second = outs
    assert first["truncated"] and second["truncated"]
    assert first["tokens_evaluated"] > 1100 and second["tokens_evaluated"] > 1100
    assert second["timings"]["prompt_n"] < 100  # of over 1,100: 77 when written
    assert (
        second["timings"]["cache_n"] == second["tokens_evaluated"] - second["timings"]["prompt_n"]
    )


@pytest.mark.model
def test_infill_answers_llama_vscodes_three_completions_as_a_list(fim_server):
    """llama.vscode asks for n_cmpl 3 (llama.cpp then answers a list, one object each)
    after a warm-up of its files with n_predict 0 and t_max_predict_ms 1."""
    files = [{"filename": "a.py", "text": "A = 1\n"}]
    warm = {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": files}
    warm |= {"prompt": "", "n_predict": 0, "samplers": [], "cache_prompt": True}
    warm |= {"t_max_prompt_ms": 500, "t_max_predict_ms": 1}
    out = fim_server.http("POST", "/infill", json=warm).json()
    assert (out["content"], out["tokens_predicted"]) == ("", 0)
    ask = {**warm, "input_prefix": BEFORE, "input_suffix": AFTER, "n_predict": 32, "n_cmpl": 3}
    ask |= {"top_k": 40, "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"]}
    ask |= {"t_max_predict_ms": 1000}
    out = fim_server.http("POST", "/infill", json=ask).json()
    assert [(o["index"], o["content"], o["stop_type"]) for o in out] == [
        (i, MIDDLE, "eos") for i in range(3)
    ]


@pytest.mark.model
def test_infill_ends_at_a_line_outside_the_block_or_at_the_time_limit(fim_server):
    """n_indent: the middle ends where a line indented less than the cursor's starts
    (stop_type limit, the line's indentation kept); t_max_predict_ms: past it, the middle
    ends once it holds a line break; a stream sends the same middle, then the last object."""
    out = fim_server.http("POST", "/infill", json={**INFILL, "n_indent": 4}).json()
    assert (out["content"], out["stop_type"]) == ("return a + b\n    x = 2\n", "limit")
    out = fim_server.http("POST", "/infill", json={**INFILL, "t_max_predict_ms": 1}).json()
    assert (out["content"], out["stop_type"]) == ("return a + b\n    ", "limit")
    body = {**INFILL, "stream": True, "n_indent": 4}
    with httpx.stream("POST", f"{fim_server.url}/infill", json=body, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [json.loads(x[len("data: ") :]) for x in r.iter_lines() if x.startswith("data: ")]
    assert "".join(x["content"] for x in lines) == "return a + b\n    x = 2\n"
    assert [x["stop"] for x in lines] == [False] * (len(lines) - 1) + [True]
    assert (lines[-1]["content"], lines[-1]["stop_type"]) == ("", "limit")


BAD_INFILL = [
    ({"input_extra": "x"}, 400,
     'input_extra must be a list of at most 1024 {"filename", "text"} objects'),
    ({"input_extra": [{"path": "a"}]}, 400,
     "input_extra[0].path is not a field of a chunk; send filename, text"),
    ({"input_prefix": 5}, 400, "input_prefix must be a string, got 5"),
    ({"n_probs": 5}, 400, "n_probs 5 is not supported on /infill; send 0 or leave it out"),
    ({"grammar": "x"}, 400, "grammar is not a field of /infill here; see docs/serve.md"),
    ({"n_indent": -1}, 400, "n_indent must be in [0, 2147483647], got -1; 0: no limit"),
    ({"n_predict": -3}, 400,
     "n_predict must be in [-2, 2147483647], got -3; -1: until the model stops"),
    ({"repeat_penalty": 0}, 400, "repeat_penalty must be above 0, got 0"),
    ({"stop": [""]}, 400, "stop strings must not be empty"),
    ({"model": "qwen2.5-coder"}, 404, "The model 'qwen2.5-coder' does not exist on this server"),
]  # fmt: skip


@pytest.mark.model
@pytest.mark.parametrize("body, status, message", BAD_INFILL)
def test_infill_refuses_what_it_cannot_read_in_llama_cpps_error_shape(
    fim_server, body, status, message
):
    r = fim_server.http("POST", "/infill", json={**INFILL, **body})
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"code", "message", "type"} and err["code"] == status
    assert err["message"].startswith(message), err["message"]


@pytest.mark.model
def test_infill_on_a_model_without_fim_says_so(plain_server):
    r = plain_server.http("POST", "/infill", json=INFILL)
    assert r.status_code == 400
    assert r.json()["error"] == {
        "code": 400,
        "message": "the model 'smollm2-135m' has no fill-in-the-middle tokens (as code models "
        "such as Qwen2.5-Coder, StarCoder2, DeepSeek-Coder and Codestral have), so /infill "
        "cannot run on it; serve a code model",
        "type": "invalid_request_error",
    }


def test_a_line_outside_the_block_ends_the_middle_a_blank_one_too(default_model_path):
    """The finish rule behind n_indent, token by token on the real tokenizer: the middle
    ends where a line indented less than the limit starts (a blank line's break is such a
    start), its indentation kept; a line that is only blanks so far is not decided."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxkv.engine.finish import FinishRule

    tok = load_tokenizer(default_model_path)

    def middle(text: str, indent: int) -> tuple[str, str]:
        rule, shown = FinishRule(tok, (), 100, min_indent=indent), ""
        for t in tok.encode(text, add_special_tokens=False):
            delta, reason = rule.add(t)
            shown += delta
            if reason:
                break
        rest, whole = rule.end()
        assert shown + rest == whole
        return whole, rule.reason

    assert middle("x = 1\n    y = 2\n\n    z = 3", 4) == ("x = 1\n    y = 2\n", "indent")
    assert middle("x = 1\n    y = 2\n  z", 4) == ("x = 1\n    y = 2\n  ", "indent")
    assert middle("x = 1\n\ty\n    ", 1) == ("x = 1\n\ty\n    ", "length")
