"""``mlxkv plan MODEL``: will it fit? Weights + KV + runtime vs the memory of this machine
or of the Mac you name (``--backend metal --memory 16GB``), and what would fit (``--fit``).

Exit 0 fits, 1 does not fit (or the context is past the model's trained context without a
window, which ``generate`` refuses), 2 bad input (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import json
import sys

from mlxkv.errors import UserError

HELP = "check whether a model fits in memory (weights, KV cache, runtime) before loading it"
KV_DTYPES = ("float16", "bfloat16", "float32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Numbers are parsed in run(): argparse's own errors print a usage block, not one line.
    a = parser.add_argument
    a("model", metavar="MODEL", help="config.json file, model folder, registry alias, hub id, "
      "or .gguf file (converted once, cached: it holds no config.json)")  # fmt: skip
    a("--context", metavar="N", help="tokens in the cache (prompt + reply); default 4096")
    a("--batch", metavar="B", help="sequences run together; default 1")
    a("--chunk", metavar="N", help="prefill chunk size (tokens per model call); default 512")
    a("--kv-window", metavar="W", help="keep the last W tokens of growing layers")
    a("--kv-sinks", metavar="S", help="attention-sink tokens kept with a window; default 4")
    a("--kv-bits", metavar="b", help="quantize growing layers' keys and values to b bits "
      "(2, 3, 4, 5, 6 or 8): keys per channel in groups of tokens (KIVI), values per "
      "token")  # fmt: skip
    a("--kv-key-bits", metavar="b", help="bits for keys only (overrides --kv-bits)")
    a("--kv-value-bits", metavar="b", help="bits for values only (overrides --kv-bits)")
    a("--kv-group-size", metavar="g", help="quantization group size; default 64")
    a("--kv-value-group-size", metavar="g", help="group size for values; default --kv-group-size")
    a("--kv-dtype", metavar="DTYPE", help="KV dtype: float16, bfloat16 or float32 "
      "(default: what the engine uses on this backend)")  # fmt: skip
    a("--memory", metavar="SIZE", help="memory to plan against, e.g. 16GB, 16GiB, 512M "
      "(default: what this machine reports); with --backend metal, the Mac's RAM (16GB = a "
      "16 GB Mac, planned against Metal's recommended working set: 2/3 of RAM up to 36 GB, "
      "3/4 above)")  # fmt: skip
    a("--backend", metavar="metal|cuda|cpu", help="plan for Apple Silicon (metal: checkpoint "
      "dtype, packed quantized weights, fused attention), an NVIDIA GPU (cuda: the same "
      "dtype rule; memory: the GPU's) or MLX's CPU backend (float32); "
      "default: this machine's")  # fmt: skip
    a("--weight-bits", metavar="b", help="plan the model as an MLX conversion with weights "
      "quantized to b bits (mlx_lm.convert -q --q-bits b, group 64)")  # fmt: skip
    a("--fit", action="store_true", help="when it does not fit, list settings that do, as "
      "the flags to pass, cheapest in measured quality first")  # fmt: skip
    a("--chart", nargs="?", const="-", metavar="FILE.png", help="chart total memory against "
      "context for this policy and the alternatives, with the budget as a line: in the "
      "terminal, or as a PNG (needs matplotlib)")  # fmt: skip
    a("--json", action="store_true", help="print the plan as JSON")
    from mlxkv.commands import plan_hosts

    plan_hosts.add_arguments(parser)


def _int(value: str | None, flag: str, default: int | None, minimum: int) -> int | None:
    from mlxkv.memory.config import BadInput

    if value is None:
        return default
    try:
        n = int(value)
    except ValueError:
        k = value[:-1] if value[-1:] in ("k", "K") else ""
        hint = f" (write {int(k) * 1024} for {k}K tokens)" if k.isdigit() else ""
        raise BadInput(f"{flag} must be an integer, got '{value}'{hint}") from None
    if n < minimum:
        raise BadInput(f"{flag} must be at least {minimum}, got {n}")
    return n


def _estimate(args):
    from mlxkv.memory.config import BadInput
    from mlxkv.memory.estimate import estimate_model
    from mlxkv.models.resolve import resolve_config
    from mlxkv.policy import KVPolicy

    context = _int(args.context, "--context", None, 1)
    batch = _int(args.batch, "--batch", 1, 1)
    chunk = _int(args.chunk, "--chunk", 512, 1)
    policy = KVPolicy.from_flags(
        window=_int(args.kv_window, "--kv-window", None, 1),
        sinks=_int(args.kv_sinks, "--kv-sinks", None, 0),
        bits=_int(args.kv_bits, "--kv-bits", None, 1),
        group_size=_int(args.kv_group_size, "--kv-group-size", None, 1),
        key_bits=_int(args.kv_key_bits, "--kv-key-bits", None, 1),
        value_bits=_int(args.kv_value_bits, "--kv-value-bits", None, 1),
        value_group_size=_int(args.kv_value_group_size, "--kv-value-group-size", None, 1),
    )
    if args.kv_dtype is not None and args.kv_dtype not in KV_DTYPES:
        raise BadInput(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got '{args.kv_dtype}'")
    return estimate_model(
        resolve_config(args.model),
        policy,
        context,
        batch,
        chunk,
        args.kv_dtype,
        args.memory,
        search=True,
        on=args.backend,
        weight_bits=_int(args.weight_bits, "--weight-bits", None, 2),
    )


def run(args) -> int:
    if args.shard is not None and args.hosts is None:
        print(
            "mlxkv plan: error: --shard splits a model over --hosts N; add --hosts", file=sys.stderr
        )
        return 2
    if args.hosts is not None:
        from mlxkv.commands import plan_hosts

        given = [flag for flag, on in (("--fit", args.fit), ("--chart", args.chart)) if on]
        if given:
            print(
                f"mlxkv plan: error: {' and '.join(given)} "
                f"{'plans' if len(given) == 1 else 'plan'} one host and cannot be used with "
                f"--hosts; drop --hosts (--fit then proposes a host count) or drop "
                f"{' and '.join(given)}",
                file=sys.stderr,
            )
            return 2
        return plan_hosts.run(args, _estimate)
    try:
        est = _estimate(args)
        suggestions = None
        if args.fit:
            from mlxkv.memory.fit import suggest

            suggestions = suggest(est)
        chart = None
        if args.chart is not None:
            from mlxkv.commands.plan_chart import chart_file, chart_text, curves

            data = curves(est)
            chart = chart_text(data) if args.chart == "-" else chart_file(data, args.chart)
    except UserError as e:
        print(f"mlxkv plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        d = to_json(est, suggestions)
        if chart is not None and args.chart != "-":
            d["chart_file"] = args.chart
        print(json.dumps(d, indent=2))
    else:
        print(render(est, suggestions))
        if chart is not None:
            print(chart)
    return 0 if est.runnable else 1


# --- reporting ---------------------------------------------------------------------------


def _token_bytes(spec, policy, kv_dtype: str) -> int:
    """Bytes one token adds to this cache (batch 1), with the policy's bits if it applies."""
    from mlxkv.memory import policy_bytes
    from mlxkv.memory.dtypes import dtype_bytes

    if spec.grows:
        b = dtype_bytes(spec.dtype or kv_dtype)
        return policy_bytes.token_bytes(policy, spec.kv_heads, spec.k_head_dim, spec.v_head_dim, b)
    return spec.bytes_per_token(kv_dtype)


def _layer_row(layer, s) -> dict:
    kv = [p for p in layer.parts if p.kv_heads]
    first = kv[0] if kv else None
    window = None
    if first is not None:
        if first.grows and s.policy.window is not None:
            window = s.policy.window + s.policy.sinks
        else:
            window = first.window
    return {
        "index": layer.index,
        "kind": layer.kind,
        "cache": "+".join(p.cls for p in layer.parts),
        "kv_heads": first.kv_heads if first else 0,
        "head_dim": first.k_head_dim if first else 0,
        "v_head_dim": first.v_head_dim if first else 0,
        "window": window,
        "policy_applies": any(p.grows for p in layer.parts),
        "bytes_per_token": sum(_token_bytes(p, s.policy, s.kv_dtype) for p in layer.parts),
        "state_bytes": sum(p.state_bytes(s.kv_dtype) for p in layer.parts),
    }


def to_json(est, suggestions=None) -> dict:
    s, b = est.setting, est.budget
    rows = [_layer_row(li, s) for li in est.layout.layers]
    rt = b.runtime
    return {
        "model": est.name,
        "model_type": est.layout.model_type,
        "mlx_lm_module": est.layout.module,
        "resolved_as": est.source.how,
        "backend": s.backend,
        "context": s.context,
        "batch": s.batch,
        "chunk": s.chunk,
        "policy": s.policy.to_dict(),
        "kv_dtype": s.kv_dtype,
        "layers": rows,
        "kv_bytes_per_token": sum(r["bytes_per_token"] for r in rows),
        "kv_state_bytes": sum(r["state_bytes"] for r in rows) * s.batch,
        "kv_tokens_kept": b.kv.kept_tokens,
        "kv_bytes": b.kv.logical,
        "kv_bytes_allocated": b.kv.peak_allocated,
        "weights_bytes": b.weights.bytes,
        "weights_file_bytes": b.weights.file_bytes,
        "weights_params": b.weights.params,
        "weights_source": b.weights.source,
        "activation_bytes": rt.activation_bytes,
        "logits_bytes": rt.logits_bytes,
        "overhead_bytes": rt.overhead_bytes,
        "estimated": ["activation_bytes", "logits_bytes", "overhead_bytes"],
        "total_bytes": b.total,
        "available_bytes": b.available,
        "available_source": est.memory.source,
        "fits": b.fits,
        "max_context": est.max_context,
        "max_batch": est.max_batch,
        "notes": est.notes + est.fit_notes,
        "memory_total_bytes": est.memory.total,
        "weight_bits": est.weight_bits,
        "fused_attention": rt.fused_attention,
        "trained_context": est.trained_context,
        "past_trained_context": est.past_trained_context,
        "window_instead": _window_instead(est),
        "runnable": est.runnable,
        "wired_limit": None
        if est.wired is None
        else {
            "command": est.wired.command,
            "limit_mb": est.wired.limit_mb,
            "headroom_bytes": est.wired.headroom,
        },
        "load_wired_limit_bytes": est.load_wired_limit,
        "suggestions": None if suggestions is None else [x.to_dict() for x in suggestions],
    }


def _window_instead(est) -> dict | None:
    """What ``--kv-window`` would give instead of a full cache past the trained context."""
    from mlxkv.memory.fit import window_instead

    return window_instead(est)


def _gib(n: int) -> str:
    return f"{n / 2**30:10.2f} GiB"


def _groups(rows: list[dict]) -> list[tuple[int, dict]]:
    """Identical layers collapsed, in order of first appearance."""
    keys = ("kind", "cache", "kv_heads", "head_dim", "v_head_dim", "window")
    seen: dict[tuple, list] = {}
    for r in rows:
        k = tuple(r[x] for x in keys) + (r["bytes_per_token"], r["state_bytes"])
        seen.setdefault(k, [0, r])[0] += 1
    return [(n, r) for n, r in seen.values()]


def render(est, suggestions=None) -> str:
    d = to_json(est)
    s = est.setting
    weights = f"{d['weight_bits']}-bit MLX conversion, " if d["weight_bits"] else ""
    out = [
        f"{d['model']}: model_type {d['model_type']} (mlx-lm module {d['mlx_lm_module']}, "
        f"{d['resolved_as']})",
        f"context {s.context:,} tokens, batch {s.batch}, prefill chunk {s.chunk}, "
        f"KV policy {s.policy.describe()}, KV {s.kv_dtype} ({weights}{s.backend} backend)",
        "",
        f"  {'layers':>6}  {'kind':<16} {'cache':<22} {'kv heads':>8} {'head dim':>9} "
        f"{'window':>7} {'bytes/token':>12} {'state bytes':>12}",
    ]
    for n, r in _groups(d["layers"]):
        dims = f"{r['head_dim']}/{r['v_head_dim']}" if r["kv_heads"] else "-"
        out.append(
            f"  {n:>6}  {r['kind']:<16} {r['cache']:<22} {r['kv_heads'] or '-':>8} {dims:>9} "
            f"{r['window'] or '-':>7} {r['bytes_per_token']:>12,} {r['state_bytes']:>12,}"
        )
    spare = d["available_bytes"] - d["total_bytes"]
    verdict = (
        f"FITS ({spare / 2**30:.2f} GiB to spare)"
        if d["fits"]
        else f"DOES NOT FIT ({-spare / 2**30:.2f} GiB short)"
    )
    if d["past_trained_context"]:
        verdict += (", but" if d["fits"] else ", and") + " past the trained context (below)"
    attention = "fused attention, no score matrix" if d["fused_attention"] else "scores held"
    available = d["available_source"]
    if d["memory_total_bytes"] and s.backend in ("metal", "cuda"):
        available += f", of {d['memory_total_bytes'] / 2**30:.0f} GiB"
    out += [
        "",
        f"  KV bytes per token: {d['kv_bytes_per_token']:,} (all layers, batch 1)",
        f"  weights          {_gib(d['weights_bytes'])}  {d['weights_bytes'] / 1e9:.2f} GB, "
        f"{d['weights_source']}",
        f"  KV logical       {_gib(d['kv_bytes'])}  {d['kv_tokens_kept']:,} tokens kept per layer",
        f"  KV allocated     {_gib(d['kv_bytes_allocated'])}  held by MLX (peak while prefilling)",
        f"  activations      {_gib(d['activation_bytes'])}  estimate: one {s.chunk}-token chunk, "
        f"{attention}",
        f"  logits           {_gib(d['logits_bytes'])}  estimate: sampling step, float32",
        f"  overhead         {_gib(d['overhead_bytes'])}  estimate: runtime + allocator slack",
        f"  total            {_gib(d['total_bytes'])}",
        f"  available        {_gib(d['available_bytes'])}  {available}",
        f"  verdict          {verdict}",
        "",
    ]
    mc = d["max_context"]
    tc = d["trained_context"]
    beyond = tc and s.policy.window is None and (mc is None or mc > tc)
    out.append(
        f"  largest context that fits at batch {s.batch}: "
        + ("any (every cache is bounded)" if mc is None else f"{mc:,} tokens")
        + (f" (the model is trained on {tc:,})" if beyond else "")
    )
    out.append(f"  largest batch that fits at {s.context:,} tokens: {d['max_batch']:,}")
    if d["past_trained_context"]:
        out.append(
            f"  PAST THE TRAINED CONTEXT: {s.context:,} tokens > {tc:,}; generate refuses a "
            "full cache this long"
        )
        wi = d["window_instead"]
        if wi:
            verdict = "fits" if wi["fits"] else "does not fit"
            out.append(
                f"    {' '.join(wi['flags'])} keeps every distance in range: total "
                f"{wi['total_bytes'] / 2**30:.2f} GiB, {verdict}"
            )
    elif tc:
        out.append(f"  trained context: {tc:,} tokens")
    if d["wired_limit"]:
        w = d["wired_limit"]
        out.append(
            f"  raise the GPU wired limit to fit: {w['command']} "
            f"(leaves {w['headroom_bytes'] / 2**30:.1f} GiB to macOS; resets at reboot)"
        )
    if d["load_wired_limit_bytes"]:
        out.append(
            f"  wired at load: {d['load_wired_limit_bytes'] / 2**30:.2f} GiB "
            "(weights + margin, at most the working set)"
        )
    for note in d["notes"]:
        out.append(f"  note: {note}")
    if suggestions is not None:
        out += _render_suggestions(est, suggestions)
    elif not est.runnable:
        out.append("  (--fit lists settings that fit, as the flags to pass)")
    return "\n".join(out)


def _render_suggestions(est, suggestions) -> list[str]:
    if est.runnable:
        return ["", "  --fit: it already fits as asked"]
    if not suggestions:
        return ["", "  --fit: no setting mlxkv can change makes it fit"]
    out = ["", "  --fit: these fit (add to the command; cheapest in measured quality first):"]
    for x in suggestions:
        cost = x.kv_cost if x.quality.cost is None else x.quality.cost
        shown = "     ?" if cost is None else f"{cost:+6.1%}"
        tail = "  (weights: unmeasured)" if x.weight_bits is not None else ""
        out.append(
            f"    total {x.budget.total / 2**30:6.2f} GiB, {x.spare / 2**30:5.2f} spare, "
            f"quality {shown}  {' '.join(x.flags)}{tail}"
        )
    src = {x.quality.source for x in suggestions if x.quality.source}
    if src:
        out.append(f"    quality: {'; '.join(sorted(src))}")
    return out
