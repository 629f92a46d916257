"""``--chat-template FILE``: a user's Jinja template renders conversations in place of the
model's own, in every command that renders them; ``--chat-template-args JSON``: arguments
every render gets unless its caller gives them. A bad file or argument is refused in one
line before anything loads or is written."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.bad_input import refused, snapshot
from tests.serve_helpers import serving

# ChatML with the answer begun: what it renders differs from SmolLM2's own template
# (which adds a system prompt), so a test can tell which one ran
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\nThe answer is{% endif %}"
)
QUESTION = "What is the capital of France?"
RENDERED = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\nThe answer is"

# Hermes-style tool calls (mlx-lm's json_tools format), which SmolLM2's template lacks
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    '{% endfor %}.\nCall one as <tool_call>{"name": ..., "arguments": ...}</tool_call>'
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    '{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{"name": '
    '"{{ c.function.name if c.function else c.tool_call.name }}"}</tool_call>{% endfor %}'
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if greeting %}{{ greeting }}: "
    "{% endif %}{% endif %}"
)


@pytest.mark.model
def test_generate_answers_the_text_the_file_renders(cli, tmp_path):
    """The greedy answer under --chat-template is, token for token, the plain completion
    of the text the file renders (and not of what the model's template renders)."""
    f = tmp_path / "chatml.jinja"
    f.write_text(TEMPLATE)
    args = ["--max-tokens", "8", "--temp", "0", "--json"]
    given = cli("generate", "--chat-template", str(f), "-p", QUESTION, *args)
    assert given.returncode == 0, given.stderr
    assert f"mlxkv: chat template from {f}\n" in given.stderr
    raw = cli("generate", "--raw", "-p", RENDERED, *args)
    own = cli("generate", "-p", QUESTION, *args)
    a, b, c = (json.loads(r.stdout) for r in (given, raw, own))
    assert (a["text"], a["prompt_tokens"]) == (b["text"], b["prompt_tokens"])
    assert a["prompt_tokens"] != c["prompt_tokens"]  # the model's own adds a system prompt


@pytest.mark.parametrize("command", ["generate", "serve", "batch", "chat"])
def test_a_missing_file_is_refused_before_anything_loads(capsys, tmp_path, command):
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    argv = {
        "generate": ["-p", "hi"],
        "serve": ["--port", "0"],
        "batch": [str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")],
        "chat": [],
    }[command]
    before = snapshot(tmp_path)
    line = refused(capsys, command, "--chat-template", str(tmp_path / "none.jinja"), *argv)
    assert line == f"mlxkv {command}: error: --chat-template {tmp_path}/none.jinja does not exist"
    assert snapshot(tmp_path) == before  # batch wrote no output file


@pytest.mark.parametrize(
    "content, words",
    [
        (b"{% for m in messages %}", "is not a Jinja template (line 1: Unexpected end of template"),
        (b"{{ messages }\n", "is not a Jinja template (line 1: unexpected '}'"),
        (b"\xff\xfe{{ messages }}", "is not UTF-8 text (byte 0)"),
        (b"x" * ((1 << 20) + 1), "is 1,048,577 bytes, more than the 1,048,576 bytes allowed"),
    ],
    ids=["unclosed", "bad-syntax", "not-utf8", "too-big"],
)
def test_a_bad_file_is_one_line(capsys, tmp_path, content, words):
    f = tmp_path / "t.jinja"
    f.write_bytes(content)
    line = refused(capsys, "generate", "--chat-template", str(f), "-p", "hi")
    assert line.startswith(f"mlxkv generate: error: --chat-template {f} {words}"), line
    assert f.read_bytes() == content


def test_raw_and_a_template_file_do_not_go_together(capsys, tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    line = refused(capsys, "generate", "--raw", "--chat-template", str(f), "-p", "hi")
    assert line == (
        "mlxkv generate: error: --raw skips the chat template that --chat-template is for; drop one"
    )


@pytest.mark.model
def test_a_file_that_fails_as_it_renders_is_named(capsys, tmp_path):
    f = tmp_path / "strict.jinja"
    f.write_text("{{ raise_exception('this template takes no user messages') }}")
    line = refused(capsys, "generate", "--chat-template", str(f), "-p", "hi", "--max-tokens", "2")
    assert line.endswith(
        "the chat template strict.jinja failed: this template takes no user messages"
    ), line


@pytest.mark.model
def test_a_batch_run_again_with_another_template_answers_its_lines_again(cli, preloaded, tmp_path):
    """A batch's records carry the template file and arguments in their fingerprints: the
    same run resumes with nothing to do; another file or other arguments run every line
    again. (The loaded model is shared here: what is checked is which lines run.)"""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"id": "q", "messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    first, second = tmp_path / "a.jinja", tmp_path / "b.jinja"
    first.write_text(TEMPLATE)
    second.write_text(TEMPLATE.replace("The answer is", "Sure,"))
    run = ["batch", str(inp), "-o", str(out), "--max-tokens", "3"]
    assert cli(*run, "--chat-template", str(first)).returncode == 0
    again = cli(*run, "--chat-template", str(first))
    assert "nothing left to run" in again.stderr
    other = cli(*run, "--chat-template", str(second))
    assert "1 lines changed since their records; running them again" in other.stderr
    args = cli(*run, "--chat-template", str(second), "--chat-template-args", '{"x": 1}')
    assert "1 lines changed since their records; running them again" in args.stderr


@pytest.mark.parametrize(
    "given, words",
    [
        ("{enable_thinking: false}", " is not JSON (Expecting property name enclosed in double"),
        ('["enable_thinking"]', " must be a JSON object, e.g. '{\"enable_thinking\": false}'"),
        ('{"messages": []}', ": messages is set by mlxkv itself; drop it"),
        ('{"a": "' + "x" * (64 << 10) + '"}', " is longer than 65536 characters"),
    ],
    ids=["not-json", "not-object", "reserved", "too-long"],
)
def test_bad_template_arguments_are_one_line(capsys, tmp_path, given, words):
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    before = snapshot(tmp_path)
    out = str(tmp_path / "out.jsonl")
    line = refused(
        capsys, "batch", str(tmp_path / "in.jsonl"), "-o", out, "--chat-template-args", given
    )
    assert line.startswith(f"mlxkv batch: error: --chat-template-args{words}"), line
    assert snapshot(tmp_path) == before


# -- through the server ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve_template")
    f = folder / "tools.jinja"
    f.write_text(TOOLS_TEMPLATE)
    args = json.dumps({"greeting": "Hello from the server"})
    yield from serving(folder, "--chat-template", str(f), "--chat-template-args", args)


@pytest.mark.model
def test_a_served_template_file_renders_and_lets_the_model_call_tools(server):
    """The server renders with the file (llama.cpp's /apply-template and /props show it),
    and the tool-call format it writes (mlx-lm's json_tools) lets SmolLM2, whose own
    template has none, take tools: Ollama's /api/show lists the capability, and a request
    with tools, which the model's own template answers with a 400 tools_unsupported, is
    answered."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    body = {"messages": messages, "tools": tools}
    r = httpx.post(f"{server.url}/apply-template", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == (
        '<|im_start|>system\nTools: get_weather.\nCall one as <tool_call>{"name": ..., '
        '"arguments": ...}</tool_call><|im_end|>\n<|im_start|>user\nWeather in Paris?'
        "<|im_end|>\n<|im_start|>assistant\nHello from the server: "
    )
    # a request's own chat_template_kwargs win over the server's --chat-template-args
    mine = {**body, "chat_template_kwargs": {"greeting": "Mine"}}
    r = httpx.post(f"{server.url}/apply-template", json=mine, timeout=60)
    assert r.json()["prompt"].endswith("<|im_start|>assistant\nMine: ")
    props = httpx.get(f"{server.url}/props", timeout=60).json()
    assert props["chat_template"] == TOOLS_TEMPLATE
    show = httpx.post(f"{server.url}/api/show", json={"model": server.model}, timeout=60).json()
    assert "tools" in show["capabilities"]
    client = server.client()
    auto = client.chat.completions.create(
        model=server.model, messages=messages, tools=tools, max_tokens=8, temperature=0
    )
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_template_that_writes_tool_calls_brings_their_format(default_model_path):
    """The tool-call format is read from the file as mlx-lm reads it from a model's
    template: SmolLM2 gets json_tools (its markers, its parser) from one that writes
    <tool_call> JSON; a later file that shows no format keeps it."""
    from mlx_lm.tokenizer_utils import load

    from mlxkv.models.chat_template import ChatTemplate, install, use_template

    tokenizer = load(default_model_path)
    install(tokenizer)
    assert not tokenizer.has_tool_calling
    use_template(tokenizer, ChatTemplate(TOOLS_TEMPLATE, "tools.jinja"))
    assert (tokenizer.tool_call_start, tokenizer.tool_call_end) == ("<tool_call>", "</tool_call>")
    assert tokenizer.tool_call_start_tokens == tuple(
        tokenizer.encode("<tool_call>", add_special_tokens=False)
    )
    call = tokenizer.tool_parser('{"name": "get_weather", "arguments": {"city": "Paris"}}', None)
    assert call == {"name": "get_weather", "arguments": {"city": "Paris"}}
    use_template(tokenizer, ChatTemplate(TEMPLATE, "chatml.jinja"))
    assert tokenizer.tool_call_start == "<tool_call>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nThe answer is"
