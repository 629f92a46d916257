"""Engine events turned into OpenAI response objects (whole answers and stream chunks)."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from functools import lru_cache

from mlxkv.engine.events import Stats, TokenDelta
from mlxkv.engine.grammar import guidance_tokenizer
from mlxkv.server.reasoning import ThinkReader
from mlxkv.server.tools import CallReader

FINISH_REASONS = {
    "stop": "stop",
    "stop_string": "stop",
    "length": "length",
    "context": "length",
    # a code completion's limits (llama.cpp's n_indent and t_max_predict_ms)
    "indent": "length",
    "time": "length",
}


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


class TokenText:
    """Each token's own text (for logprobs), as the tokenizer decodes it alone, and its own
    bytes: a token that holds part of a character decodes to U+FFFD, while its bytes are
    what a client joins to the whole character (OpenAI's ``bytes``)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._decode)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)
        self._raw = None  # llguidance's view of the tokenizer, built at the first bytes asked

    def _decode(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _bytes(self, token: int) -> bytes:
        if self._raw is None:
            try:
                self._raw = guidance_tokenizer(self.tokenizer)
            except Exception:  # a tokenizer llguidance cannot read: the text's bytes
                self._raw = False
        if self._raw:
            try:
                return self._raw.decode_bytes([token])
            except Exception:  # an id past the tokenizer's vocabulary (a padded head)
                pass
        return self.text(token).encode("utf-8")


@dataclass
class Part:
    """What one event of an answer adds: content, reasoning, tool calls, the token's
    logprobs, or the finish reason (as the API names it)."""

    text: str = ""
    reasoning: str = ""
    calls: list[dict] = field(default_factory=list)
    entry: dict | None = None
    reason: str | None = None

    def __bool__(self) -> bool:
        return bool(self.text or self.reasoning or self.calls or self.entry or self.reason)


@dataclass
class Choice:
    """One answer as it arrives."""

    index: int
    reader: CallReader | None = None  # set when the request offered tools
    think: ThinkReader | None = None  # set when the model has think markers
    text: list[str] = field(default_factory=list)  # the content (tool calls taken out)
    reasoning: list[str] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)  # tool calls, as a stream sends them
    logprobs: list[dict] = field(default_factory=list)  # chat entries, one per token
    finish_reason: str | None = None
    stop: str | None = None  # the stop string that ended it
    stats: Stats | None = None
    echo: str | None = None  # completions with echo: the prompt's text, before the answer
    prompt_logprobs: list[dict] = field(default_factory=list)  # echo: the prompt's entries
    reasoning_tokens: int = 0  # tokens whose text went (even in part) to the reasoning

    def read(self, text: str) -> Part:
        """New text of the answer: what may be sent now (a call inside the reasoning is
        reasoning)."""
        thought, text = self.think.feed(text) if self.think else ("", text)
        self.reasoning_tokens += bool(thought)
        return self._keep(thought, *(self.reader.feed(text) if self.reader else (text, [])))

    def close(self) -> Part:
        """The answer ended: what the readers still held."""
        thought, text = self.think.close() if self.think else ("", "")
        if self.reader is None:
            return self._keep(thought, text, [])
        text, calls = self.reader.feed(text)
        rest, last = self.reader.close()
        return self._keep(thought, text + rest, calls + last)

    def _keep(self, thought: str, text: str, calls: list[dict]) -> Part:
        self.reasoning.append(thought)
        self.text.append(text)
        self.calls += calls
        return Part(text=text, reasoning=thought, calls=calls)

    @property
    def reason(self) -> str | None:
        """The API's finish reason: an answer that ended by itself after calling a tool
        ends with "tool_calls"."""
        reason = FINISH_REASONS.get(self.finish_reason, self.finish_reason)
        return "tool_calls" if self.calls and reason == "stop" else reason


def chat_logprob(words: TokenText, ev: TokenDelta) -> dict | None:
    """A chat ``logprobs.content`` entry for the token of ``ev`` (None when it has none)."""
    if ev.logprob is None or ev.token < 0:
        return None
    return token_entry(words, ev.token, ev.logprob, ev.top_logprobs or ())


def token_entry(words: TokenText, token: int, lp: float | None, top) -> dict:
    """A token's logprobs entry: its text, logprob (None: the prompt's first token, which
    nothing scores) and its best alternatives."""

    def one(token: int, lp: float | None) -> dict:
        return {"token": words.text(token), "logprob": lp, "bytes": list(words.bytes(token))}

    entry = one(token, lp)
    entry["top_logprobs"] = None if lp is None else [one(t, x) for t, x in top]
    return entry


def without_bytes(entry: dict) -> dict:
    """A logprob entry as stream events carry it (OpenAI's Responses, Ollama's): no bytes."""
    top = [{"token": t["token"], "logprob": t["logprob"]} for t in entry["top_logprobs"] or ()]
    return {"token": entry["token"], "logprob": entry["logprob"], "top_logprobs": top}


def prompt_entries(words: TokenText, ev) -> list[dict]:
    """A PromptLogprobs event as logprobs entries, one per prompt token."""
    entries = [token_entry(words, ev.tokens[0], None, ())]
    for token, lp, top in zip(ev.tokens[1:], ev.logprobs, ev.top, strict=True):
        entries.append(token_entry(words, token, lp, top))
    return entries


def completion_logprobs(entries: list[dict], offset: int = 0) -> dict:
    """The legacy completions ``logprobs`` object from chat-style entries."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        out["tokens"].append(e["token"])
        out["token_logprobs"].append(e["logprob"])
        top = e["top_logprobs"]
        out["top_logprobs"].append(None if top is None else {t["token"]: t["logprob"] for t in top})
        out["text_offset"].append(offset)
        offset += len(e["token"])
    return out


def kv_figures(s: Stats) -> dict:
    """The ``mlxkv`` usage extension every API's answer carries: the KV cache it ran in,
    as MLX holds it and as the memory model predicts it."""
    return {
        "kv_tokens": s.kv_tokens,
        "kv_bytes_actual": s.kv_bytes_actual,
        "kv_bytes_predicted": s.kv_bytes_predicted,
        "policy": s.policy,
    }


def usage(choices: list[Choice], n: int) -> dict:
    """Token counts over the answers (each prompt counted once) and, as the ``mlxkv``
    extension, the KV figures of the first answer: the cache it ran in, as MLX holds it
    and as the memory model predicts it (a batched answer's cache is the batch's)."""
    finals = [c.stats for c in choices if c.stats is not None]
    prompt = sum(c.stats.prompt_tokens for c in choices if c.stats and c.index % n == 0)
    cached = sum(c.stats.prompt_tokens_cached for c in choices if c.stats and c.index % n == 0)
    completion = sum(s.generation_tokens for s in finals)
    first = finals[0] if finals else Stats()
    out = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "mlxkv": {"prompt_tokens_cached": cached, **kv_figures(first)},
    }
    drafted = sum(s.draft_tokens for s in finals)
    if drafted:  # as OpenAI counts a predicted output's tokens: taken, and checked in vain
        taken = sum(s.draft_tokens_accepted for s in finals)
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": taken,
            "rejected_prediction_tokens": drafted - taken,
        }
    return out


@dataclass
class Envelope:
    """What every object of one response shares."""

    kind: str  # "chat" | "completion"
    model: str
    id: str = ""
    created: int = 0

    def __post_init__(self):
        self.id = self.id or new_id("chatcmpl" if self.kind == "chat" else "cmpl")
        self.created = self.created or int(time.time())

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -- whole answers -----------------------------------------------------------------
    def whole(self, choices: list[Choice], n: int) -> dict:
        out = []
        for c in choices:
            text = "".join(c.text)
            reason = c.reason
            if self.kind == "chat":
                lp = {"content": c.logprobs, "refusal": None} if c.logprobs else None
                message = {"role": "assistant", "content": text, "refusal": None}
                if any(c.reasoning):
                    message["reasoning_content"] = "".join(c.reasoning)
                if c.calls:
                    # as OpenAI: no content beside the calls unless the model wrote some
                    message["content"] = text if text.strip() else None
                    message["tool_calls"] = [
                        {k: v for k, v in call.items() if k != "index"} for call in c.calls
                    ]
                out.append(
                    {
                        "index": c.index,
                        "message": message,
                        "logprobs": lp,
                        "finish_reason": reason,
                    }
                )
            else:
                entries = c.prompt_logprobs + c.logprobs
                lp = completion_logprobs(entries) if entries else None
                text = (c.echo or "") + text
                out.append(
                    {"index": c.index, "text": text, "logprobs": lp, "finish_reason": reason}
                )
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {**self.head(obj), "choices": out, "usage": usage(choices, n)}

    # -- stream chunks ------------------------------------------------------------------
    def chunk(self, choices: list[dict], with_usage: bool, usage_value=None) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out = {**self.head(obj), "choices": choices}
        if with_usage:
            out["usage"] = usage_value
        return out

    def opening(self, index: int) -> dict:
        """A chat stream's first chunk of each answer: its role."""
        d = {"role": "assistant", "content": ""}
        return {"index": index, "delta": d, "logprobs": None, "finish_reason": None}

    def delta(self, index: int, part: Part, offset: int) -> dict:
        """One choice's part of a chunk."""
        if self.kind == "chat":
            d = {}
            if part.reasoning:
                d["reasoning_content"] = part.reasoning
            if part.text or not (part.reasoning or part.calls or part.reason):
                d["content"] = part.text
            if part.calls:
                d["tool_calls"] = part.calls
            lp = {"content": [part.entry], "refusal": None} if part.entry else None
            return {"index": index, "delta": d, "logprobs": lp, "finish_reason": part.reason}
        lp = completion_logprobs([part.entry], offset) if part.entry else None
        return {"index": index, "text": part.text, "logprobs": lp, "finish_reason": part.reason}
