"""``mlxkv plan MODEL --hosts N``: the plan for a model split across N machines.

The arithmetic is ``mlxkv.memory.hosts``; this module parses the two flags and prints.
"""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--hosts", metavar="N", help="plan for the model split across N machines (mlx.launch); "
      "--memory then takes one size for all or one per host: 64GB,32GB,...")  # fmt: skip
    a("--shard", metavar="MODE", help="how --hosts split the model: tensor "
      "(KV heads split N ways), pipeline (layers split N ways) or auto (tensor where "
      "mlx-lm's model has shard() and its heads divide N ways, else pipeline)")  # fmt: skip


def run(args, estimate) -> int:
    """``estimate(args)`` is plan's whole-model estimate; exit 0 all fit, 1 not, 2 bad input."""
    import sys

    from mlxkv.errors import UserError
    from mlxkv.memory.config import BadInput
    from mlxkv.memory.hosts import host_memories, plan_hosts

    try:
        try:
            n = int(args.hosts)
        except ValueError:
            raise BadInput(f"--hosts must be an integer, got '{args.hosts}'") from None
        if n < 1:
            raise BadInput(f"--hosts must be at least 1, got {n}")
        memory = args.memory
        # The whole-model estimate is only the single-host comparison: plan it on host 0.
        args.memory = host_memories(memory, n)[0]
        est = estimate(args)
        hp = plan_hosts(est.config, est.layout, est.setting, n, args.shard or "auto", memory)
    except UserError as e:
        print(f"mlxkv plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(to_json(est, hp), indent=2))
    else:
        print(render(est, hp))
    return 0 if hp.fits else 1


def _host_json(h) -> dict:
    b, rt = h.budget, h.budget.runtime
    heads = sorted({p.kv_heads for p in h.layout.specs() if p.kv_heads})
    heads = heads[0] if len(heads) == 1 else (heads or None)  # None: no KV heads here
    return {
        "rank": h.rank,
        "layers": list(h.layers),
        "kv_heads_per_layer": heads,
        "weights_bytes": b.weights.bytes,
        "weights_params": b.weights.params,
        "kv_bytes": b.kv.allocated,
        "kv_bytes_logical": b.kv.logical,
        "kv_bytes_peak": b.kv.peak_allocated,
        "activation_bytes": rt.activation_bytes,
        "logits_bytes": rt.logits_bytes,
        "overhead_bytes": rt.overhead_bytes,
        "total_bytes": b.total,
        "available_bytes": b.available,
        "available_source": h.memory.source,
        "fits": b.fits,
        "max_context": h.max_context,
        "max_batch": h.max_batch,
    }


def to_json(est, hp) -> dict:
    s, one = est.setting, est.budget
    return {
        "model": est.name,
        "model_type": est.layout.model_type,
        "hosts": len(hp.hosts),
        "shard": hp.mode,
        "backend": s.backend,
        "context": s.context,
        "batch": s.batch,
        "chunk": s.chunk,
        "policy": s.policy.to_dict(),
        "kv_dtype": s.kv_dtype,
        "per_host": [_host_json(h) for h in hp.hosts],
        "fits": hp.fits,
        "tightest_host": hp.tightest.rank,
        "max_context": hp.max_context,
        "max_batch": hp.max_batch,
        "single_host": {
            "weights_bytes": one.weights.bytes,
            "kv_bytes": one.kv.allocated,
            "total_bytes": one.total,
        },
        "estimated": ["activation_bytes", "logits_bytes", "overhead_bytes"],
        "notes": est.notes + _host_notes(hp),
    }


def _host_notes(hp) -> list[str]:
    """What a host's verdict rests on (the whole-model notes are about one host)."""
    return [
        f"host {h.rank}: its weights alone exceed its available memory"
        for h in hp.hosts
        if h.budget.weights.bytes > h.budget.available
    ]


def _g(n: int) -> str:
    return f"{n / 2**30:9.2f}"


def render(est, hp) -> str:
    s = est.setting
    d = to_json(est, hp)
    n = len(hp.hosts)
    how = (
        "KV heads and MLP split N ways, embeddings and head on every host"
        if hp.mode == "tensor"
        else "layers split N ways (rank 0 runs the last ones), embeddings and head on every host"
    )
    out = [
        f"{d['model']} over {n} hosts, {hp.mode} parallel: {how}",
        f"context {s.context:,} tokens, batch {s.batch}, prefill chunk {s.chunk}, "
        f"KV policy {s.policy.describe()}, KV {s.kv_dtype} ({s.backend} backend)",
        "",
        f"  {'host':>4} {'layers':>9} {'kv heads':>8} {'weights':>9} {'KV':>9} {'runtime':>9} "
        f"{'total':>9} {'available':>9}  verdict   (GiB)",
    ]
    for h in d["per_host"]:
        rt = h["activation_bytes"] + h["logits_bytes"] + h["overhead_bytes"]
        layers = f"{h['layers'][0]}-{h['layers'][1] - 1}"
        out.append(
            f"  {h['rank']:>4} {layers:>9} {str(h['kv_heads_per_layer'] or '-'):>8} "
            f"{_g(h['weights_bytes'])} {_g(h['kv_bytes_peak'])} {_g(rt)} {_g(h['total_bytes'])} "
            f"{_g(h['available_bytes'])}  {'fits' if h['fits'] else 'DOES NOT FIT'}"
        )
    one = d["single_host"]
    t = hp.tightest
    mc = d["max_context"]
    out += [
        "",
        f"  one host would hold {one['total_bytes'] / 2**30:.2f} GiB "
        f"(weights {one['weights_bytes'] / 2**30:.2f}, KV {one['kv_bytes'] / 2**30:.2f})",
        f"  verdict: {'FITS on every host' if hp.fits else 'DOES NOT FIT on every host'}; "
        f"tightest host: {t.rank}",
        f"  largest context that fits on every host at batch {s.batch}: "
        + ("any (every cache is bounded)" if mc is None else f"{mc:,} tokens"),
        f"  largest batch that fits on every host at {s.context:,} tokens: {d['max_batch']:,}",
        "  run it: mlx.launch --hostfile hosts.json -- $(which mlxkv) generate --prompt ... "
        f"--shard {hp.mode} (see docs/distributed.md)",
    ]
    for note in d["notes"]:
        out.append(f"  note: {note}")
    return "\n".join(out)
