"""The scheduler's status read as figures: what ``GET /metrics`` exports and ``mlxkv top``
draws. Plain dicts in, plain numbers out (no MLX, no HTTP): a key a server does not report
reads as 0 (or empty), so an older server's status still reads."""

from __future__ import annotations

import math

MEMORY_KEYS = (
    "weights_bytes",
    "runtime_bytes",
    "reserved_bytes",
    "prefix_cache_bytes",
    "kv_bytes_actual",
    "kv_bytes_predicted",
    "active_bytes",
    "peak_bytes",
    "cache_bytes",
)
COUNTERS = (  # counters since the server started
    "requests_finished",
    "prompt_tokens_prefilled",
    "prompt_tokens_cached",
    "tokens_generated",
    "draft_tokens",
    "draft_tokens_accepted",
    "steps",
)


def integer(d: dict | None, key: str) -> int:
    """``d[key]`` as an int; a missing key, null, a non-number, NaN or an infinity (JSON
    from another server may hold them) reads as 0."""
    value = _number(d, key)
    return 0 if value is None else int(value)


def real(d: dict | None, key: str) -> float:
    """``d[key]`` as a float; what is not a finite number reads as 0.0."""
    value = _number(d, key)
    try:
        return 0.0 if value is None else float(value)
    except OverflowError:  # an integer past a float's range
        return 0.0


def _number(d: dict | None, key: str) -> int | float | None:
    value = d.get(key) if isinstance(d, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return None if isinstance(value, float) and not math.isfinite(value) else value


def running(status: dict) -> list[dict]:
    rows = status.get("running")
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def queue(status: dict) -> list[dict]:
    """The waiting requests in order (those the server lists; ``waiting`` counts them all)."""
    rows = status.get("queue")
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def waiting(status: dict) -> int:
    return integer(status, "waiting")


def batch_bytes(rows: list[dict], key: str) -> int:
    """The sum of ``key`` over batches: every row of a batch reports the batch's bytes
    (``batch_rows`` rows each), so each row counts for 1/batch_rows of them."""
    total = 0.0
    for r in rows:
        total += integer(r, key) / max(integer(r, "batch_rows"), 1)
    return round(total)


def memory(status: dict) -> dict:
    """The ``memory`` section with every key: ``budget_bytes`` is None when the server has
    no budget. Without the section the KV bytes are summed from the running batches."""
    section = status.get("memory")
    mem = {k: integer(section, k) for k in MEMORY_KEYS}
    budget = section.get("budget_bytes") if isinstance(section, dict) else None
    mem["budget_bytes"] = (
        budget if isinstance(budget, int) and not isinstance(budget, bool) else None
    )
    if not isinstance(section, dict):
        rows = running(status)
        mem["kv_bytes_actual"] = batch_bytes(rows, "kv_bytes")
        mem["kv_bytes_predicted"] = batch_bytes(rows, "kv_bytes_predicted")
        mem["reserved_bytes"] = sum(integer(r, "reserved_bytes") for r in rows)
    return mem


def machine(status: dict) -> dict | None:
    """The machine's free memory against the server's floor (``--memory-floor``): free and
    floor bytes, whether the last reading was under it, the times it fell under and the
    bytes given back since the start; None when the server keeps no floor."""
    section = status.get("machine_memory")
    if not isinstance(section, dict):
        return None
    free = section.get("free_bytes")
    keys = ("floor_bytes", "times_under", "given_back_bytes")
    return {
        "free_bytes": free if isinstance(free, int) and not isinstance(free, bool) else None,
        "under_floor": section.get("under_floor") is True,
        **{k: integer(section, k) for k in keys},
    }


def counters(status: dict) -> dict[str, int]:
    return {k: integer(status, k) for k in COUNTERS}


def batches(status: dict) -> dict[str, int]:
    """The batches (/v1/batches) waiting to run, and the running one's requests in flight,
    answered and in all (0 where none runs)."""
    section = status.get("batches")
    now = batch(status) or (0, 0)
    return {
        "waiting": integer(section, "waiting") if isinstance(section, dict) else 0,
        "in_flight": integer(section, "requests_in_flight") if isinstance(section, dict) else 0,
        "answered": now[0],
        "total": now[1],
    }


def batch(status: dict) -> tuple[int, int] | None:
    """The running batch's (/v1/batches) requests answered and in all; None when none
    runs."""
    section = status.get("batches")
    now = section.get("running") if isinstance(section, dict) else None
    if not isinstance(now, dict):
        return None
    return integer(now, "completed") + integer(now, "failed"), integer(now, "total")


def refused(status: dict) -> dict[str, int]:
    section = status.get("refused")
    return {"busy": integer(section, "busy"), "too_large": integer(section, "too_large")}


def prefix_cache(status: dict) -> dict:
    """Both tiers of the prefix cache: entries, bytes, limit, hits and hit ratio. The
    status counts every lookup that reused tokens in ``hits`` and every one that did not
    in ``misses``; ``disk.hits`` are the hits whose entry was read from disk first. So
    the memory tier's hits are ``hits - disk.hits``, and each tier's hit ratio is its hits
    over all lookups (the two add up to the cache's hit ratio)."""
    section = status.get("prefix_cache")
    section = section if isinstance(section, dict) else {}
    disk = section.get("disk") if isinstance(section.get("disk"), dict) else {}
    keys = ("entries", "bytes", "limit_bytes")
    hits, disk_hits, misses = (
        integer(section, "hits"),
        integer(disk, "hits"),
        integer(section, "misses"),
    )
    tiers = {
        "memory": {**{k: integer(section, k) for k in keys}, "hits": max(hits - disk_hits, 0)},
        "disk": {**{k: integer(disk, k) for k in keys}, "hits": disk_hits},
    }
    lookups = max(hits, disk_hits) + misses
    for tier in tiers.values():
        tier["hit_ratio"] = tier["hits"] / lookups if lookups else 0.0
    dir_ = disk.get("dir")
    tiers["disk"]["dir"] = dir_ if isinstance(dir_, str) else None
    return {
        **tiers,
        "misses": misses,
        "lookups": lookups,
        "tokens_reused": integer(section, "tokens_reused"),
    }
