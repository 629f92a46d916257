"""Every field of a full request to each API, replaced in turn by a value of the wrong
shape, against a real server: each answer is a 2xx or 4xx in that API's error shape,
never a 5xx, and the server logs no traceback (about 2300 requests in all, 26-45 s)."""

from __future__ import annotations

import copy
import json

import httpx
import pytest

from tests.serve_helpers import serving

FN = {"name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}
CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
OLLAMA_CALL = {"name": "f", "arguments": {}}
THOUGHT = {"type": "reasoning_text", "text": "t"}
USE = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
RESULT = {"type": "tool_result", "tool_use_id": "t", "content": "r"}
BODIES = {
    "/v1/chat/completions": {
        "max_tokens": 1,
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": "x", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c", "content": "r"},
            {"role": "user", "content": "q"},
        ],
        "stop": ["a"],
        "logit_bias": {"5": 1},
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {}}},
        "kv": {"window": 64, "sinks": 4},
        "tool_choice": "none",
        "tools": [{"type": "function", "function": FN}],
    },
    "/v1/completions": {"max_tokens": 1, "prompt": ["hi", "yo"], "logprobs": 1, "stop": "x"},
    "/v1/responses": {
        "max_output_tokens": 1,
        "instructions": "i",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "o"},
            {"type": "reasoning", "summary": [], "content": [THOUGHT]},
            {"role": "user", "content": "q"},
        ],
        "metadata": {"k": "v"},
        "text": {"format": {"type": "text"}},
        "truncation": "auto",
        "include": ["message.output_text.logprobs"],
    },
    "/v1/messages": {
        "max_tokens": 1,
        "system": [{"type": "text", "text": "s"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": [USE]},
            {"role": "user", "content": [RESULT]},
        ],
        "stop_sequences": ["x"],
        "thinking": {"type": "disabled"},
        "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto"},
    },
    "/api/chat": {
        "model": "smollm2-135m",
        "stream": False,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": OLLAMA_CALL}]},
            {"role": "tool", "content": "r"},
        ],
        "options": {"num_predict": 1, "stop": ["x"], "num_ctx": 128},
        "format": {"type": "object"},
        "tools": [{"type": "function", "function": FN}],
    },
    "/api/generate": {
        "model": "smollm2-135m",
        "stream": False,
        "prompt": "hi",
        "system": "s",
        "options": {"num_predict": 1, "seed": 1},
    },
    "/tokenize": {
        "model": "smollm2-135m",
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": True,
        "return_token_strs": True,
    },
    "/detokenize": {"model": "smollm2-135m", "tokens": [1, 2]},
    # (the default model has no fill-in-the-middle tokens: what parses is refused after)
    "/infill": {
        "input_prefix": "def f():\n",
        "input_suffix": "x",
        "input_extra": [{"filename": "a.py", "text": "b"}],
        "prompt": "  ",
        "n_predict": 1,
        "n_cmpl": 1,
        "n_indent": 2,
        "t_max_predict_ms": 5,
        "samplers": ["top_k"],
        "response_fields": ["content"],
        "stop": ["x"],
    },
    "/completion": {"prompt": "hi", "n_predict": 1, "stop": ["x"], "response_fields": ["content"]},
    "/apply-template": {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": FN}],
    },
    "/v1/embeddings": {"input": ["hi", "yo"], "dimensions": 8, "encoding_format": "base64"},
    "/api/embed": {"model": "smollm2-135m", "input": ["hi"], "truncate": True, "options": {}},
    "/api/embeddings": {"model": "smollm2-135m", "prompt": "hi"},
    "/v1/messages/count_tokens": {
        "system": "s",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
    },
    "/v1/responses/input_tokens": {
        "instructions": "i",
        "input": [{"role": "user", "content": "q"}],
    },
    "/v1/conversations": {
        "items": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        ],
        "metadata": {"k": "v"},
    },
    "/api/show": {"model": "smollm2-135m", "verbose": True},
    # (its input_file_id: a file the server fixture uploads)
    "/v1/batches": {
        "input_file_id": "",
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        "metadata": {"k": "v"},
        "output_expires_after": {"anchor": "created_at", "seconds": 3600},
    },
}  # fmt: skip
BODIES["/v1/chat/completions"] |= {"n_predict": 1, "id_slot": 0, "samplers": ["top_k"]}
# lists and objects whose fields are lists cannot be dictionary keys (every suite); then
# every other type (the slow suite)
QUICK = [[], {"type": []}]
WIDE = [{}, [[]], None, -1, 1.5, True, "x", 2**70]
# Ollama's num_predict -1 (and llama.cpp's n_predict) asks for an answer as long as the
# context: a valid, long request
LONG = {("options", "num_predict"): (-1,), ("n_predict",): (-1,)}


def paths(o, at=()):
    if isinstance(o, dict):
        items = o.items()
    elif isinstance(o, list):
        items = enumerate(o)
    else:
        return
    for k, v in items:
        yield (*at, k)
        yield from paths(v, (*at, k))


def replaced(body: dict, at: tuple, value) -> dict:
    out = copy.deepcopy(body)
    node = out
    for k in at[:-1]:
        node = node[k]
    node[at[-1]] = value
    return out


def error_shaped(url: str, body) -> bool:
    if url.startswith("/api/"):
        return isinstance(body, dict) and isinstance(body.get("error"), str)
    err = body.get("error") if isinstance(body, dict) else None
    if url == "/v1/messages" and body.get("type") != "error":
        return False
    return isinstance(err, dict) and isinstance(err.get("message"), str)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    for s in serving(tmp_path_factory.mktemp("serve_fuzz"), "--max-tokens", "1"):
        line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions"}
        line["body"] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        upload = {"file": ("in.jsonl", json.dumps(line).encode())}
        r = httpx.post(f"{s.url}/v1/files", data={"purpose": "batch"}, files=upload)
        s.batch_file = r.json()["id"]
        yield s


def shake(server, values: list) -> list[str]:
    """Every path of every body with each value; what went wrong, one line each."""
    wrong = []
    bodies = dict(BODIES)
    bodies["/v1/batches"] = {**BODIES["/v1/batches"], "input_file_id": server.batch_file}
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for url, body in bodies.items():
            for at in paths(body):
                for value in values:
                    if value in LONG.get(at, ()):
                        continue
                    r = http.post(url, json=replaced(body, at, value))
                    if r.status_code >= 500 or (
                        r.status_code >= 400 and not error_shaped(url, r.json())
                    ):
                        wrong.append(f"{url} {at} = {value!r}: {r.status_code} {r.text[:120]}")
    return wrong


def test_no_field_of_the_wrong_shape_makes_a_server_error(server):
    assert shake(server, QUICK) == []
    assert "Traceback" not in server.log()


@pytest.mark.slow
def test_no_value_of_the_wrong_type_makes_a_server_error(server):
    assert shake(server, WIDE) == []
    assert "Traceback" not in server.log()
