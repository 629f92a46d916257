"""A batch job over the ranks of ``mlx.launch``: rank 0 owns the files, the others compute.

* data (every rank a whole model): rank 0 cuts the work into rounds of ``ranks x batch``
  prompts, sends each rank its share, runs its own, then gathers the others' results and
  hands them to the caller (which appends them to the one output file). A round in flight
  when a rank dies is not written, so a re-run resumes with nothing lost or duplicated.
* sharded (tensor / pipeline: one model split over the ranks): every forward pass is a
  collective, so every rank must run the same prompts in the same order. Rank 0 sends the
  whole list once; all ranks run it in lockstep and rank 0 keeps the results.

Messages are JSON over ``mx.distributed`` send/recv (``mlxkv.engine.distributed``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict
from itertools import islice

from mlxkv.engine.batch import BatchRunner, Request, Result
from mlxkv.engine.distributed import Cluster, recv_obj, send_obj
from mlxkv.engine.request import settings_from_json, settings_to_json


def _pack(req: Request) -> dict:
    return {"key": req.key, "prompt": req.prompt, "settings": settings_to_json(req.settings)}


def _unpack(d: dict) -> Request:
    return Request(d["key"], d["prompt"], settings_from_json(d["settings"]))


class DataParallel:
    """Rank 0's side of a data-parallel batch; followers call :func:`follow_data`."""

    def __init__(self, cluster: Cluster, runner: BatchRunner, per_rank: int):
        self.cluster, self.runner, self.per_rank = cluster, runner, per_rank
        self.done_by_rank = [0] * cluster.size

    def run(self, requests: Iterable[Request]) -> Iterator[Result]:
        size = self.cluster.size
        pending = iter(requests)
        try:
            while True:
                # Pulled lazily: the caller's generator may write error records meanwhile.
                round_ = list(islice(pending, size * self.per_rank))
                if not round_:
                    break
                shares = [round_[r::size] for r in range(size)]
                busy = [r for r in range(1, size) if shares[r]]
                for r in busy:
                    send_obj(self.cluster, [_pack(q) for q in shares[r]], r)
                for res in self.runner.run(shares[0]):
                    self.done_by_rank[0] += 1
                    yield res
                for r in busy:
                    for d in recv_obj(self.cluster, r):
                        self.done_by_rank[r] += 1
                        yield Result(**d)
        finally:
            stop_followers(self.cluster)


def stop_followers(cluster: Cluster) -> None:
    """Tell every follower there is no more work (``None``). Safe to call twice."""
    if cluster.stopped:
        return
    cluster.stopped = True
    for r in range(1, cluster.size):
        try:
            send_obj(cluster, None, r)
        except RuntimeError:
            pass  # that rank is gone already; mlx.launch reports it


def follow_data(cluster: Cluster, runner: BatchRunner) -> int:
    """A follower's loop: run each share rank 0 sends, send the results back; None ends it."""
    n = 0
    while True:
        share = recv_obj(cluster, 0)
        if share is None:
            return n
        results = [asdict(r) for r in runner.run(_unpack(d) for d in share)]
        n += len(results)
        send_obj(cluster, results, 0)


class Lockstep:
    """Rank 0's side of a batch over a sharded model; followers call :func:`follow_lockstep`."""

    def __init__(self, cluster: Cluster, runner: BatchRunner):
        self.cluster, self.runner = cluster, runner

    def run(self, requests: Iterable[Request]) -> Iterator[Result]:
        todo = list(requests)
        for r in range(1, self.cluster.size):
            send_obj(self.cluster, [_pack(q) for q in todo], r)
        self.cluster.stopped = True
        yield from self.runner.run(todo)


def follow_lockstep(cluster: Cluster, runner: BatchRunner) -> int:
    """A follower's side of :class:`Lockstep`: the same prompts, results dropped."""
    todo = [_unpack(d) for d in recv_obj(cluster, 0) or ()]
    return sum(1 for _ in runner.run(todo))
