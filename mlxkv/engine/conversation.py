"""What a conversation to answer must be, checked the same way for every front end that
reads one from a file (``generate --messages``, ``batch`` lines)."""

from __future__ import annotations

ROLES = ("system", "user", "assistant")
# Messages of a conversation. Rendering and tokenizing are linear (about 2 s per 10,000
# short messages here), but the model then reads every token: 100,000 short messages are
# 1.3 million tokens, hours of prefill on a CPU.
MAX_MESSAGES = 10_000


def plain_messages(messages):
    """OpenAI's forms of messages as the plain ones (what chat apps and OpenAI's batch files
    hold): a developer message is a system message, and content given as a list of text
    parts is their joined text. Anything else is left as it is, for
    :func:`conversation_problem` to name."""
    if not isinstance(messages, list):
        return messages
    return [_plain(m) for m in messages]


def _plain(m):
    if not isinstance(m, dict):
        return m
    content = m.get("content")
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        m = {**m, "content": "".join(p["text"] for p in content)}
    return {**m, "role": "system"} if m.get("role") == "developer" else m


def conversation_problem(messages) -> str | None:
    """What keeps ``messages`` from being a conversation to answer, worded to follow its
    name (None: nothing): it must be a list of 1 to MAX_MESSAGES {"role", "content": text}
    objects, a system message only first, and not only a system message."""
    if not isinstance(messages, list) or not messages:
        return 'must be a non-empty list of {"role", "content"} objects'
    if len(messages) > MAX_MESSAGES:
        return (
            f"holds {len(messages):,} messages; mlxkv answers conversations of up to "
            f"{MAX_MESSAGES:,}: keep the last ones (every message is read again, token by "
            "token, even under --kv-window)"
        )
    for i, m in enumerate(messages):
        if not (
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
        ):
            shape = '{"role": "system"|"user"|"assistant", "content": "text"}'
            return f"has message {i} that is not {shape}"
        if m["role"] == "system" and i:
            return f"has a system message at {i}; a system message may only come first"
    if all(m["role"] == "system" for m in messages):
        return "has no user message to answer"
    return None
