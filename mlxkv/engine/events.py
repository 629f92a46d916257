"""What the engine tells its callers: plain dataclasses, no MLX objects."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Stats:
    """A snapshot taken after every token. Bytes are exact integers."""

    prompt_tokens: int = 0  # tokens of this turn's whole prompt
    prompt_tokens_cached: int = 0  # of which reused from the cache (not prefilled)
    generation_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    kv_tokens: int = 0  # tokens the growing layers keep now
    kv_evicted: int = 0  # tokens dropped by a window policy so far
    kv_tokens_seen: int = 0  # tokens the cache holds a trace of (kept + evicted)
    kv_bytes_actual: int = 0  # sum of the caches' nbytes (what MLX holds)
    kv_bytes_predicted: int | None = None  # the memory model's allocated bytes
    kv_bytes_logical: int | None = None  # the memory model's kept-token bytes
    active_memory: int = 0  # MLX active memory, bytes
    peak_memory: int = 0  # MLX peak memory, bytes
    weights_bytes: int = 0
    context_limit: int | None = None
    policy: str = "full"
    finish_reason: str | None = None
    draft_tokens: int = 0  # tokens guessed from the conversation and checked (lookup)
    draft_tokens_accepted: int = 0  # of which the model agreed with

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PrefillProgress:
    done: int
    total: int
    stats: Stats | None = None


@dataclass(frozen=True)
class TokenDelta:
    text: str  # new text to append (may be empty while a stop string is pending)
    token: int  # -1 for text flushed at the end of an answer
    stats: Stats
    logprob: float | None = None  # the token's log-probability, when the request asked
    top_logprobs: tuple[tuple[int, float], ...] | None = None  # best alternatives, when asked


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt scored by the model (a request with ``prompt_logprobs``), sent once its
    prefill ends: each token after the first, its log-probability given those before it,
    and the best ``prompt_logprobs`` tokens there."""

    tokens: tuple[int, ...]  # the whole prompt
    logprobs: tuple[float, ...]  # for tokens[1:]
    top: tuple[tuple[tuple[int, float], ...], ...]  # for tokens[1:], best first


@dataclass(frozen=True)
class Embedding:
    """The prompt's final hidden state pooled into one vector (a request with ``embed``),
    sent once its prefill ends, before ``Finished``; not normalized."""

    vector: tuple[float, ...]


@dataclass(frozen=True)
class Notice:
    """Something the user should know that is not an error (e.g. the cache was rebuilt)."""

    message: str


@dataclass(frozen=True)
class Finished:
    text: str  # the whole answer of this turn
    finish_reason: str  # stop | length | stop_string | cancelled | context
    stats: Stats
    stop: str | None = None  # the stop string that ended it (finish_reason stop_string)


@dataclass(frozen=True)
class Failed:
    """The request could not run; it comes instead of any other event."""

    message: str  # one line for the user
    code: str  # invalid_policy | context_length_exceeded | shutting_down | internal


Event = PrefillProgress | PromptLogprobs | Embedding | TokenDelta | Notice | Finished | Failed
