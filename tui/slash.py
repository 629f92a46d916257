"""Slash commands typed in the input box: parsing only (the app runs them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mlxkv.errors import UserError
from mlxkv.policy import KVPolicy, PolicyError

COMMANDS = {
    "/policy": "window=W sinks=S bits=B kbits= vbits= group=G | full  change the KV cache "
    "policy (says what re-reading costs first)",
    "/set": "temp T | top_p P | rep R | max_tokens N  sampling (no argument: show it)",
    "/system": "[TEXT]  set the system prompt (no text: show it; '-' clears it)",
    "/clear": "drop the conversation and the cache",
    "/regen": "answer the last message again",
    "/save": "[PATH.md|PATH.json]  save the transcript",
    "/load": "PATH.json  load a conversation saved with /save",
    "/history": "[N]  list the kept conversations (N: reopen one)",
    "/model": "NAME  switch model (memory check first)",
    "/copy": "copy the last answer",
    "/help": "this help",
}

KEYS = {
    "Enter": "send",
    "Shift+Enter / Ctrl+J": "new line",
    "Up / Down": "previous / next prompt",
    "Esc / Ctrl+C": "stop the answer (Ctrl+C when idle: how to quit)",
    "Ctrl+R": "regenerate",
    "Ctrl+L": "clear",
    "Ctrl+Y": "copy the last answer (c on a focused message)",
    "Ctrl+P": "command palette",
    "F1": "help",
    "F2": "show / hide the KV panel (hidden below 80 columns)",
    "Ctrl+Q": "quit",
}


def help_text() -> str:
    keys = "\n".join(f"  {k:<22} {v}" for k, v in KEYS.items())
    cmds = "\n".join(f"  {k:<9} {v}" for k, v in COMMANDS.items())
    return f"Keys\n{keys}\nCommands\n{cmds}"


@dataclass(frozen=True)
class Command:
    name: str  # e.g. "/policy"
    arg: str


def parse(text: str) -> Command | None:
    """A slash command, or None for a normal message ('//x' sends '/x' as text)."""
    stripped = text.strip()
    if not stripped.startswith("/") or stripped.startswith("//"):
        return None
    name, _, arg = stripped.partition(" ")
    return Command(name.lower(), arg.strip())


_KEYS = {"window": "window", "w": "window", "sinks": "sinks", "s": "sinks", "bits": "bits"}
_KEYS |= {"b": "bits", "group": "group", "g": "group", "group_size": "group"}
_KEYS |= {"key_bits": "key_bits", "kbits": "key_bits", "value_bits": "value_bits"}
_KEYS |= {"vbits": "value_bits", "value_group": "value_group", "vgroup": "value_group"}


def parse_policy(arg: str, current: KVPolicy) -> KVPolicy:
    """``window=256 sinks=4 bits=4 group=64`` or ``full`` (no window), applied on top of
    the current policy; ``bits=none`` / ``window=none`` turn a part off. ``kbits=`` /
    ``vbits=`` / ``vgroup=`` set keys and values apart (``bits=`` sets both)."""
    if not arg:
        raise PolicyError("usage: /policy window=W sinks=S bits=B group=G, or /policy full")
    window, sinks, group = current.window, current.sinks, current.group_size
    kbits, vbits, vgroup = current.key_bits, current.value_bits, current.value_group_size
    given = set()
    for item in arg.replace(",", " ").split():
        if item.lower() == "full":  # every token, full precision
            window, sinks, kbits, vbits = None, 0, None, None
            given |= {"window", "sinks", "bits"}
            continue
        key, eq, raw = item.partition("=")
        if not eq or key.lower() not in _KEYS:
            raise PolicyError(
                f"/policy: cannot read {item!r}; use window=, sinks=, bits=, kbits=, vbits=, group="
            )
        key = _KEYS[key.lower()]
        if raw.lower() in ("none", "off", "no"):
            value = None
        else:
            try:
                value = int(raw)
            except ValueError:
                raise PolicyError(f"/policy: {key} must be a number or none, got {raw!r}") from None
        given.add(key)
        if key == "window":
            window = value
        elif key == "sinks":
            sinks = value or 0
        elif key == "bits":
            kbits = vbits = value
        elif key == "key_bits":
            kbits = value
        elif key == "value_bits":
            vbits = value
        elif key == "value_group":
            vgroup = value
        else:
            group = value
    if window is None:
        sinks = 0 if "sinks" not in given else sinks
    elif current.window is None and "sinks" not in given:
        sinks = None  # a new window gets the default sinks
    if "group" in given and "value_group" not in given:
        vgroup = None  # follows the key group size
    quantized = kbits is not None or vbits is not None
    return KVPolicy.from_flags(
        window=window,
        sinks=sinks,
        # the group sizes carried from a quantized policy; asked for, refused without bits
        group_size=group if quantized or "group" in given else None,
        key_bits=kbits,
        value_bits=vbits,
        value_group_size=vgroup if quantized or "value_group" in given else None,
        key_scheme=current.key_scheme,
    )


# /set NAME VALUE: names as typed -> GenerationSettings field, value type
_SETTINGS = {
    "temp": ("temperature", float),
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top-p": ("top_p", float),
    "rep": ("repetition_penalty", float),
    "repetition_penalty": ("repetition_penalty", float),
    "max_tokens": ("max_tokens", int),
    "max-tokens": ("max_tokens", int),
}


def parse_set(arg: str) -> dict:
    """``temp 0.2`` (or ``temp=0.2``, several at once) -> {"temperature": 0.2}."""
    words = arg.replace("=", " ").split()
    if not words or len(words) % 2:
        raise UserError("usage: /set temp 0.7 | top_p 0.9 | rep 1.1 | max_tokens 512")
    out = {}
    for name, raw in zip(words[::2], words[1::2], strict=True):
        if name.lower() not in _SETTINGS:
            raise UserError(f"/set: unknown setting {name!r}; use temp, top_p, rep or max_tokens")
        field, kind = _SETTINGS[name.lower()]
        try:
            value = kind(raw)
        except ValueError:
            raise UserError(f"/set {name}: {raw!r} is not a {kind.__name__}") from None
        ok, want = _RANGES[field]
        if not (math.isfinite(value) and ok(value)):
            raise UserError(f"/set {name}: give {want}, got {raw}")
        out[field] = value
    return out


# field -> (the values it takes, as the refusal says them)
_RANGES = {
    "temperature": (lambda v: v >= 0, "a number 0 or more (0 = greedy)"),
    "top_p": (lambda v: 0 < v <= 1, "a number above 0 and at most 1"),
    "repetition_penalty": (lambda v: v > 0, "a number above 0 (1 = none)"),
    "max_tokens": (lambda v: v >= 1, "a whole number 1 or more"),
}


def describe_settings(s) -> str:
    temp = "greedy" if s.temperature == 0 else f"temp {s.temperature:g}"
    rep = f"rep {s.repetition_penalty:g}" if s.repetition_penalty else "rep off"
    return f"{temp} top-p {s.top_p:g} {rep} max {s.max_tokens}"
