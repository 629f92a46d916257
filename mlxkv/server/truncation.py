"""The Responses API's ``truncation: "auto"``: a conversation that does not fit the model's
context, with room left for the answer, loses its oldest turns. The instructions (the
leading system messages) always stay, and what is kept starts at a user message, so a
function call is never parted from its output.

A cut that dropped just enough would move with every new turn, and each move changes the
prompt's first tokens: the prefix cache would miss and the whole kept conversation be read
again every turn. So the tokens to drop are rounded up to a grain (a fraction of the room),
measured from the conversation's start: the cut stays on the same message for several
turns and their prompts share its prefix (docs/serve.md has the measurement).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable

GRAINS = 4  # the room is cut in this many grains: each cut frees at least a quarter of it


def answer_room(max_tokens: int, context: int) -> int:
    """The tokens kept free for the answer: its max tokens, at most half the context."""
    return min(max_tokens, context // 2)


def fitted(
    messages: list[dict],
    count: Callable[[list[dict], bool], int | None],
    room: int,
    grains: int = GRAINS,
) -> list[dict] | None:
    """``messages`` without the oldest turns that keep it from fitting in ``room`` tokens
    (None: not even its last turn fits). ``count(messages, True)`` is the tokens of the
    prompt they make; ``count(messages, False)`` those of the same messages as the start
    of a longer prompt, or None where the chat template cannot render them alone."""
    total = count(messages, True)
    if total is None or total <= room:
        return messages
    head = 0
    while head < len(messages) and messages[head]["role"] == "system":
        head += 1
    starts = [i for i in range(head + 1, len(messages)) if messages[i]["role"] == "user"]
    grain = max(1, room // max(1, grains))
    drop = -(-(total - room) // grain) * grain
    base = count(messages[:head], False)

    def dropped_enough(i: int) -> bool:
        before = count(messages[:i], False)
        return base is None or before is None or before - base >= drop

    # no turn starts a grain's worth in: any cut that fits will do
    kept = starts[bisect_left(starts, True, key=dropped_enough) :] or starts

    def fits(i: int) -> bool:
        n = count(messages[:head] + messages[i:], True)
        return n is not None and n <= room

    k = bisect_left(kept, True, key=fits)  # both conditions hold from some turn on
    return None if k == len(kept) else messages[:head] + messages[kept[k] :]
