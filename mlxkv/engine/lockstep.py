"""One scheduler over the ranks of ``mlx.launch``: a server whose model is split over them.

Every rank runs the same :class:`~mlxkv.engine.scheduler.Scheduler`. Rank 0 takes the
requests (its HTTP server submits them) and, at the start of every step, sends the others
what changed since the last one: the requests that arrived (token ids, settings, policy),
the ones cancelled, and whether it has stopped. Each rank then runs the same step on the
same state, so every forward pass meets its collectives on every rank. This is how
``mlx_lm.server`` shares its requests between ranks too.

Each rank also sends a digest of its scheduler's state (its requests, their progress, its
kept prefixes). Ranks whose states differ would next wait in collectives that never meet;
they stop instead, every rank at the same step, with one error.
"""

from __future__ import annotations

import json
from typing import Protocol

from mlxkv.engine.request import settings_from_json, settings_to_json
from mlxkv.policy import KVPolicy


class StepExchange(Protocol):
    """What the scheduler asks of the ranks at the start of each step."""

    leader: bool

    def exchange(self, news: dict | None, digest: int) -> dict:
        """Rank 0's ``news`` on every rank (followers pass None); raises
        :class:`RanksApart` when the ranks' ``digest``s differ."""
        ...

    def largest(self, nbytes: int) -> int:
        """The largest of the ranks' ``nbytes`` (what a rank holds of a request's caches:
        ranks split by layers hold unequal shares, and all count the largest)."""
        ...


class RanksApart(RuntimeError):
    """The ranks' schedulers no longer hold the same state."""


def check_in_step(digests: list[int]) -> None:
    """Raise :class:`RanksApart` unless every rank's digest (in rank order) is rank 0's."""
    apart = [r for r, d in enumerate(digests) if d != digests[0]]
    if apart:
        raise RanksApart(
            f"rank {apart[0]}'s scheduler no longer holds what rank 0's does (a step failed "
            "on some ranks only); the server stops rather than wait on it"
        )


def pack_request(rid: int, req) -> dict:
    """A submitted request as JSON (what a follower needs to run it as rank 0 does)."""
    return {
        "id": rid,
        "ids": list(req.ids),
        "settings": settings_to_json(req.settings),
        "policy": None if req.policy is None else req.policy.to_dict(),
        "logprobs": req.logprobs,
        "prompt_logprobs": req.prompt_logprobs,
    }


def unpack_request(d: dict) -> tuple[int, dict]:
    """``(id, the Request's fields)`` from :func:`pack_request`'s JSON."""
    fields = {
        "ids": list(d["ids"]),
        "settings": settings_from_json(d["settings"]),
        "policy": None if d["policy"] is None else KVPolicy(**d["policy"]),
        "logprobs": d["logprobs"],
        "prompt_logprobs": d["prompt_logprobs"],
    }
    return d["id"], fields


class Lockstep:
    """:class:`StepExchange` over an ``mx.distributed`` group (``engine.distributed.Cluster``):
    one all-gather of (news length, digest) per step, then the news itself when there is
    any, summed from rank 0's bytes and the others' zeros."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.leader = cluster.leader

    def exchange(self, news: dict | None, digest: int) -> dict:
        import mlx.core as mx

        from mlxkv.engine.distributed import gather_ints

        data = json.dumps(news).encode() if self.leader and news else b""
        rows = gather_ints(self.cluster, [len(data), digest])
        check_in_step([row[1] for row in rows])
        size = rows[0][0]
        if size == 0:
            return {}
        if self.leader:
            buf = mx.array(memoryview(data), dtype=mx.uint8)
        else:
            buf = mx.zeros((size,), dtype=mx.uint8)
        got = mx.distributed.all_sum(buf, group=self.cluster.group, stream=mx.cpu)
        mx.eval(got)  # rank 0 too: a collective runs only where it is evaluated
        return news if self.leader else json.loads(bytes(memoryview(got)))

    def largest(self, nbytes: int) -> int:
        from mlxkv.engine.distributed import gather_ints

        return max(row[0] for row in gather_ints(self.cluster, [nbytes]))
