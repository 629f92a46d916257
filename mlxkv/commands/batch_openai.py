"""OpenAI's Batch API file format: its request lines read as this command's own lines, and
the records of those lines written in the shape of its output file, so a file made for
OpenAI's batches runs here and its results read as OpenAI's would.

A request line: ``{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body"}``
(or ``"url": "/v1/embeddings"`` with an embeddings body). Its record: ``{"id":
"batch_req_...", "line", "custom_id", "response": {"status_code": 200, "request_id", "body":
<a chat.completion, or an embeddings list>}, "error": null, "fp"}``, or with ``"response":
null`` and ``"error": {"code", "message"}`` for a line that could not run; ``line`` and
``fp`` are what a re-run resumes by, as in this command's own records.
"""

from __future__ import annotations

import time
import uuid

OPENAI_LINE = ("custom_id", "method", "url", "body")
OPENAI_URL = "/v1/chat/completions"
EMBEDDINGS_URL = "/v1/embeddings"
# the body fields this file's lines have a field for; "model" is read past: the run's model
# answers whatever it names
OPENAI_BODY = (
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "response_format",
    "min_tokens",  # vLLM's, as its batch runner takes them
    "ignore_eos",
)


def from_openai(obj: dict) -> dict | str:
    """A request line of OpenAI's Batch API as this file's own line (``custom_id`` is its
    id), or what keeps it from running here."""
    unknown = sorted(set(obj) - set(OPENAI_LINE))
    if unknown:
        return f"unknown field(s) {', '.join(unknown)} in an OpenAI batch request line"
    if obj.get("method", "POST") != "POST":
        return f"'method' must be \"POST\", got {obj['method']!r}"
    url = obj.get("url", OPENAI_URL)
    if url not in (OPENAI_URL, EMBEDDINGS_URL):
        return f"'url' {url!r}: {OPENAI_URL} and {EMBEDDINGS_URL} requests run in mlxkv batch"
    body = obj.get("body")
    if not isinstance(body, dict):
        return "'body' must be the request's JSON object"
    if url == EMBEDDINGS_URL:
        ask = embedding_ask(body)
        return f"body: {ask}" if isinstance(ask, str) else {"id": obj["custom_id"], "embed": ask}
    given = {k: v for k, v in body.items() if v is not None}
    if extra := sorted(set(given) - set(OPENAI_BODY)):
        return f"body.{extra[0]} is not supported in mlxkv batch; it takes {', '.join(OPENAI_BODY)}"
    line = {"id": obj["custom_id"]}
    if "messages" not in given:
        return "body.messages is required: the conversation to answer"
    line["messages"] = given["messages"]
    limits = [given[k] for k in ("max_tokens", "max_completion_tokens") if k in given]
    if len(limits) == 2 and limits[0] != limits[1]:
        return "body.max_tokens and body.max_completion_tokens disagree; give one"
    if limits:
        line["max_tokens"] = limits[0]
    named = ("temperature", "top_p", "seed", "stop", "min_tokens", "ignore_eos")
    line |= {k: given[k] for k in named if k in given}
    answer = given.get("response_format", {"type": "text"})
    kind = answer.get("type") if isinstance(answer, dict) else None
    schema = answer.get("json_schema") if isinstance(answer, dict) else None
    if kind == "json_object":
        line["json_schema"] = {"type": "object"}
    elif kind == "json_schema" and isinstance(schema, dict) and "schema" in schema:
        line["json_schema"] = schema["schema"]
    elif kind != "text":
        return (
            'body.response_format must be {"type": "text"}, {"type": "json_object"} '
            'or {"type": "json_schema", "json_schema": {"schema": ...}}'
        )
    return line


def embedding_ask(body: dict):
    """An embeddings request body checked (an EmbedAsk), or what is wrong with it (token
    ids are checked against the vocabulary once the model is loaded)."""
    from mlxkv.server.embeddings import MAX_INPUTS, parse_openai
    from mlxkv.server.errors import APIError
    from mlxkv.server.params import Limits

    try:
        return parse_openai(body, Limits(max_rows=MAX_INPUTS), None)
    except APIError as e:
        return e.message


def is_openai(source) -> bool:
    """Whether an input line (as parsed) is a request line of OpenAI's Batch API."""
    return isinstance(source, dict) and "custom_id" in source


# OpenAI's finish reasons for this command's: a stop string is a stop, the context's end a
# length
FINISH = {"stop": "stop", "stop_string": "stop", "length": "length", "context": "length"}


def result_record(custom_id, line: int, fp: str, model: str, r) -> dict:
    """The record of a line answered by result ``r`` (text, finish reason, token counts)."""
    body = {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": r.text, "refusal": None},
                "logprobs": None,
                "finish_reason": FINISH.get(r.finish_reason, r.finish_reason),
            }
        ],
        "usage": {
            "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.generation_tokens,
            "total_tokens": r.prompt_tokens + r.generation_tokens,
        },
    }
    response = {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body}
    return _record(custom_id, line, fp, response, None)


def embeddings_record(custom_id, line: int, fp: str, model: str, vectors, tokens, ask) -> dict:
    """The record of an embeddings line: each input's vector (``vectors``, as pooled) as
    ``ask`` wants it, in OpenAI's embeddings list."""
    from mlxkv.server.embeddings import finished, openai_body

    shaped = [finished(v, ask) for v in vectors]
    body = openai_body(model, shaped, tokens, ask.as_base64)
    response = {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body}
    return _record(custom_id, line, fp, response, None)


def error_record(custom_id, line: int, fp: str, message: str) -> dict:
    """The record of a line that could not run, with what was wrong."""
    return _record(custom_id, line, fp, None, {"code": "invalid_request", "message": message})


def _record(custom_id, line, fp, response, error) -> dict:
    # "id" and "line" first: how a torn last record is known as this command's
    return {
        "id": f"batch_req_{uuid.uuid4().hex[:24]}",
        "line": line,
        "custom_id": custom_id,
        "response": response,
        "error": error,
        "fp": fp,
    }
