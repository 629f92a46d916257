"""A page of a list, as OpenAI's API lists items, files, batches: ``limit``, ``order``,
``after`` in the query; ``data``, ``first_id``, ``last_id``, ``has_more`` in the answer."""

from __future__ import annotations

from collections.abc import Mapping

from mlxkv.server.errors import bad
from mlxkv.server.params import show


def item_page(
    items: list[dict], query: Mapping[str, str], of: str, default: int = 20, most: int = 100
) -> dict:
    """A page of ``items`` (oldest first, each with an ``id``); ``of`` names whose items
    they are, for the error when ``after`` is not one; ``default`` and ``most``: the
    ``limit`` when none is given, and the largest taken."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad(f"order must be 'asc' or 'desc', got {order!r}", "order")
    limit = query.get("limit", str(default))
    if not (limit.isdigit() and 1 <= int(limit) <= most):
        raise bad(f"limit must be an integer in [1, {most}], got {limit!r}", "limit")
    items = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise bad(f"after names no item of {of}: {show(after)}", "after")
        items = items[ids.index(after) + 1 :]
    page = items[: int(limit)]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > len(page),
    }
