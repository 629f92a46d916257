"""Slash commands typed in the input box: parsing only (the app runs them)."""

from __future__ import annotations

from dataclasses import dataclass

from mlxkv.policy import KVPolicy, PolicyError

COMMANDS = {
    "/policy": "window=W sinks=S bits=B kbits= vbits= group=G | full  change the KV cache policy",
    "/system": "[TEXT]  set the system prompt (no text: show it; '-' clears it)",
    "/clear": "drop the conversation and the cache",
    "/regen": "answer the last message again",
    "/save": "[PATH.md|PATH.json]  save the transcript",
    "/load": "PATH.json  load a transcript",
    "/model": "NAME  switch model (memory check first)",
    "/copy": "copy the last answer",
    "/help": "this help",
}

KEYS = {
    "Enter": "send",
    "Shift+Enter / Ctrl+J": "new line",
    "Up / Down": "previous / next prompt",
    "Esc": "stop the answer",
    "Ctrl+R": "regenerate",
    "Ctrl+L": "clear",
    "Ctrl+Y": "copy the last answer (c on a focused message)",
    "Ctrl+P": "command palette",
    "F1": "help",
    "Ctrl+Q": "quit",
}


def help_text() -> str:
    keys = "\n".join(f"  {k:<22} {v}" for k, v in KEYS.items())
    cmds = "\n".join(f"  {k:<8} {v}" for k, v in COMMANDS.items())
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
        if item.lower() == "full":
            window, sinks = None, 0
            given |= {"window", "sinks"}
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
    return KVPolicy.from_flags(
        window=window,
        sinks=sinks,
        group_size=group,
        key_bits=kbits,
        value_bits=vbits,
        value_group_size=vgroup,
        key_scheme=current.key_scheme,
    )
