"""Running under ``mlx.launch``: the group, who prints, and small messages between ranks.

mlx.launch starts one process per rank and tells each its place through the environment
(``MLX_RANK`` plus a backend-specific address file); ``mx.distributed.init()`` reads it.
Every rank runs the same command: ranks of a sharded model run the same forward passes in
lockstep, so they must see the same prompts, the same settings and the same random seed.
Rank 0 is the one that talks to the user.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from mlxkv.errors import UserError, first_line

# Variables mlx.launch (ring, jaccl) or mpirun set for every rank.
_RANK_VARS = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def launched() -> bool:
    """True when this process was started by mlx.launch / mpirun (checked without MLX)."""
    return any(v in os.environ for v in _RANK_VARS)


@dataclass
class Cluster:
    group: object  # mx.distributed.Group
    rank: int
    size: int
    stopped: bool = False  # rank 0 told the followers there is no more work

    @property
    def leader(self) -> bool:
        return self.rank == 0


def join() -> Cluster | None:
    """The distributed group when launched with more than one rank, else None."""
    if not launched():
        return None
    import mlx.core as mx

    try:
        group = mx.distributed.init(strict=True)
    except RuntimeError as e:
        hint = ""
        if "Couldn't bind socket" in str(e):  # the ring's listening port is taken
            hint = "; a port of this rank's is in use: give mlx.launch free ones (--starting-port)"
        raise UserError(f"cannot join the distributed group mlx.launch set up: {e}{hint}") from None
    if group.size() < 2:
        return None
    return Cluster(group, group.rank(), group.size())


def quiet_followers(cluster: Cluster | None) -> None:
    """Only rank 0 writes the command's output; the others' stdout goes nowhere (their
    errors still reach stderr, which mlx.launch forwards)."""
    import sys

    if cluster is not None and not cluster.leader:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process


def on_terminate(message) -> None:
    """When mlx.launch stops this rank (SIGTERM: another rank exited), print ``message()``
    on stderr and exit 1, even while the main thread waits inside MLX for a dead peer.

    Python runs signal handlers only between bytecodes of the main thread, which may be
    blocked in a collective; the wakeup fd is written by the C-level handler at once, and a
    watcher thread reads it."""
    import signal
    import sys
    import threading

    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)
    signal.signal(signal.SIGTERM, lambda *_: None)

    def watch():
        while True:
            got = os.read(r, 1)
            if got and got[0] == signal.SIGTERM:
                print(message(), file=sys.stderr, flush=True)
                os._exit(1)

    threading.Thread(target=watch, name="mlxkv-sigterm", daemon=True).start()


def stop_with_launcher() -> None:
    """Stop this rank (SIGTERM to itself) when mlx.launch is gone. mlx.launch stops its ranks
    when one fails, but when it is killed itself its ranks run on: a server's would keep its
    port and its share of the model. Its ranks' stdin is a pipe from it (or, on another
    host, ssh's channel) that it never closes, so its end means the launcher's."""
    import signal
    import stat
    import sys
    import threading

    if "MLX_RANK" not in os.environ:  # mpirun's ranks may have no stdin at all
        return
    try:
        mode = os.fstat(sys.stdin.fileno()).st_mode
    except (OSError, ValueError):
        return
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        return

    def watch():
        fd = sys.stdin.fileno()
        while os.read(fd, 65536):
            pass  # what a user types into mlx.launch is not for a server
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="mlxkv-launcher", daemon=True).start()


def lost_peer_message(e: BaseException) -> str:
    """One line for a failure of the distributed backend (a rank died or was stopped)."""
    rank = os.environ.get("MLX_RANK", "?")
    text = first_line(e)
    return (
        f"rank {rank} lost contact with the other ranks ({text}); another rank stopped, "
        "see its error (or mlx.launch's line about it) above"
    )


def check_stdin_unused(uses_stdin: bool, what: str) -> None:
    """Refuse ``-`` (stdin) under mlx.launch: it hands its own stdin on to the ranks and
    never closes it, so reading it waits forever."""
    if uses_stdin and launched():
        raise UserError(
            f"{what} '-' reads stdin, which mlx.launch never closes for its ranks; "
            "give the input as a file"
        )


def check_same_command(cluster: Cluster, options: dict) -> None:
    """Refuse to run unless every rank has the same ``options`` (the parsed command line):
    a rank with another cache policy or model would answer its share differently, and its
    records would carry rank 0's settings."""
    import hashlib

    text = json.dumps(options, sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).digest()
    mine = [int.from_bytes(digest[i : i + 7], "little") for i in (0, 7)]  # fits int64
    rows = gather_ints(cluster, mine)
    other = next((r for r, row in enumerate(rows) if row != rows[0]), None)
    if other is not None:
        raise UserError(
            f"rank {other} was started with other options than rank 0; run the same mlxkv "
            "command on every rank"
        )


def broadcast_int(cluster: Cluster, value: int) -> int:
    """Rank 0's ``value`` on every rank."""
    import mlx.core as mx

    x = mx.array([value if cluster.leader else 0], dtype=mx.int64)
    return int(mx.distributed.all_sum(x, group=cluster.group, stream=mx.cpu).item())


def shared_seed(cluster: Cluster, seed: int | None) -> int:
    """One seed for every rank: sampling must pick the same token everywhere."""
    if seed is None and cluster.leader:
        seed = int.from_bytes(os.urandom(4), "little")
    return broadcast_int(cluster, seed or 0)


def send_obj(cluster: Cluster, obj, dst: int) -> None:
    """Send a JSON-able object to rank ``dst`` (length first, then the bytes)."""
    import mlx.core as mx

    data = json.dumps(obj).encode()
    g = cluster.group
    mx.eval(mx.distributed.send(mx.array([len(data)], dtype=mx.int64), dst, group=g, stream=mx.cpu))
    if data:
        payload = mx.array(memoryview(data), dtype=mx.uint8)
        mx.eval(mx.distributed.send(payload, dst, group=g, stream=mx.cpu))


def recv_obj(cluster: Cluster, src: int):
    import mlx.core as mx

    g = cluster.group
    n = mx.distributed.recv((1,), mx.int64, src, group=g, stream=mx.cpu)
    size = int(n.item())
    data = mx.distributed.recv((size,), mx.uint8, src, group=g, stream=mx.cpu)
    return json.loads(bytes(memoryview(data)))


def _settle() -> None:
    """Wait for every stream that may hold a collective (ours and mlx-lm's generation)."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)
    mx.synchronize()


def gather_ints(cluster: Cluster, values: list[int]) -> list[list[int]]:
    """Every rank's ``values`` (same length everywhere), in rank order, on every rank."""
    import mlx.core as mx

    # mlx-lm's generate_step leaves the next step (with its own collectives) in flight on
    # another stream; messages of two collectives at once would mix on the wire.
    _settle()
    x = mx.array([values], dtype=mx.int64)
    rows = mx.distributed.all_gather(x, group=cluster.group, stream=mx.cpu)
    return [[int(v) for v in row] for row in rows.tolist()]


def rank_kv_report(cluster: Cluster | None, loaded, stats) -> dict:
    """Per-rank KV bytes actual next to the per-host prediction (collective: every rank
    calls it), for a result object. Empty in a single process."""
    if cluster is None:
        return {}
    rows = gather_ints(
        cluster, [stats.kv_bytes_actual, stats.kv_bytes_predicted, loaded.weights_bytes]
    )
    return {
        "ranks": cluster.size,
        "shard": loaded.shard,
        "per_rank": [
            {
                "rank": r,
                "kv_bytes_actual": a,
                "kv_bytes_predicted": p,
                "weights_bytes": w,
            }
            for r, (a, p, w) in enumerate(rows)
        ],
    }
