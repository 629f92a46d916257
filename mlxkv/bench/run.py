"""One benchmark run: load the model once, run the selected sections, write the report."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path


def log(msg: str) -> None:
    print(f"mlxkv bench: {msg}", file=sys.stderr, flush=True)


def run(args, scale, batch_command=None) -> dict:
    """``batch_command(argv)`` runs ``mlxkv batch ARGV`` in this process (the batch section
    measures the command itself; the command layer hands it down)."""
    import mlxkv.bench.machine as machine
    from mlxkv.bench import configs as configs_mod
    from mlxkv.bench import corpus, engine_overhead, policies, prediction, quality, roofline
    from mlxkv.models.loader import load
    from mlxkv.models.resolve import resolve

    t_start = time.perf_counter()
    res: dict = {"scale": scale.to_dict(), "command": args.command_line, "sections": {}}
    res["machine"] = machine.describe()
    log(f"machine: {res['machine']['cpu']}, BLAS {res['machine']['blas']}")
    text = corpus.read_text(args.text)
    resolved = resolve(args.model, on_status=log)
    tic = time.perf_counter()
    loaded = load(resolved.path)
    res["model"] = {
        "name": loaded.name,
        "path": str(loaded.path),
        "dtype": loaded.dtype,
        "weights_bytes": loaded.weights_bytes,
        "context": loaded.context_length,
        "load_seconds": time.perf_counter() - tic,
    }
    context = loaded.context_length
    ids, repeated = corpus.token_stream(loaded.tokenizer, text, scale.stream_tokens)
    res["corpus"] = {"path": str(args.text), "chars": len(text), "repeated": repeated}
    cfgs = configs_mod.all_configs(scale.kept, scale.sinks)
    res["configs"] = {
        k: {"label": c.label, "side": c.side, "peer": c.peer, "bounded": c.bounded}
        for k, c in cfgs.items()
    }
    sections = args.sections
    timings = res["section_seconds"] = {}

    def timed(name):
        timings[name] = time.perf_counter() - timed.t
        log(f"{name}: {timings[name]:.0f}s")
        # A partial report after every section: a long run stopped early still leaves one.
        res["total_seconds"] = time.perf_counter() - t_start
        res["partial"] = True
        write(res, Path(args.out))
        timed.t = time.perf_counter()

    timed.t = time.perf_counter()

    if "engine" in sections:
        prompt = loaded.tokenizer.decode(ids[: scale.engine_prompt])
        e = engine_overhead.measure(
            loaded, prompt, scale.engine_decode, scale.engine_repeats, scale.chunk, log
        )
        res["sections"]["engine"] = {
            "prompt_tokens": e.prompt_tokens,
            "decode_tokens": e.decode_tokens,
            "repeats": e.repeats,
            "mlxkv": [asdict(t) for t in e.mlxkv],
            "mlx_lm": [asdict(t) for t in e.mlx_lm],
            "median": {
                side: {w: e.median(side, w) for w in ("prefill_tps", "decode_tps")}
                for side in ("mlxkv", "mlx_lm")
            },
            "ratio": {w: e.ratio(w) for w in ("prefill_tps", "decode_tps")},
        }
        timed("engine")

    # Speed pairs and long streams are independent jobs: one pool, busy to the end.
    speed_keys = [k for k in scale.speed_configs if k in cfgs] if "speed" in sections else []
    stream_keys = [k for k in scale.stream_configs if k in cfgs] if "streams" in sections else []
    jobs = policies.speed_jobs(cfgs, speed_keys, scale)
    jobs += policies.stream_jobs(cfgs, stream_keys, scale, context)
    results = {}
    if jobs:
        from mlxkv.bench import pool

        res["workers"] = workers = args.workers or pool.default_workers()
        results = pool.run_jobs(
            jobs, loaded=loaded, cfgs=cfgs, ids=ids, chunk=scale.chunk, kept=scale.kept,
            sinks=scale.sinks, workers=workers, log=log,
            on_result=lambda name: log(f"done: {name}"),
        )  # fmt: skip
    if speed_keys:
        pairs = policies.speed_pairs(cfgs, speed_keys, scale, results, log)
        res["sections"]["speed"] = {
            "prompt_tokens": scale.speed_prompt,
            "decode_tokens": scale.speed_decode,
            "pairs": [
                {
                    "mlxkv": p.mlxkv,
                    "peer": p.peer,
                    "prefill_tps": [p.median(0, "prefill_tps"), p.median(1, "prefill_tps")],
                    "decode_tps": [p.median(0, "decode_end_tps"), p.median(1, "decode_end_tps")],
                    "prefill_ratio": p.ratio("prefill_tps"),
                    "decode_ratio": p.ratio("decode_end_tps"),
                    "kv_bytes": [
                        p.runs[0][0].checkpoints[-1].kv_bytes,
                        p.runs[0][1].checkpoints[-1].kv_bytes,
                    ],
                    "mlx_peak": [
                        p.runs[0][0].checkpoints[-1].mlx_peak,
                        p.runs[0][1].checkpoints[-1].mlx_peak,
                    ],
                }  # fmt: skip
                for p in pairs
            ],
        }
    streams = {}
    if stream_keys:
        streams = policies.streams_from(cfgs, stream_keys, results, log)
        res["sections"]["streams"] = {
            k: {
                "tokens": r.tokens,
                "prefill_tps": r.prefill_tps,
                "chunk_tokens": r.chunk_tokens,
                "chunk_tps": r.chunk_tps().round(2).tolist(),
                "flatness": policies.flatness(r, scale.kept if cfgs[k].bounded else 0),
                "checkpoints": [asdict(c) for c in r.checkpoints],
            }
            for k, r in streams.items()
        }
        res["sections"]["quality"] = quality.summary(streams, context)
        res["sections"]["prediction"] = prediction.compare(loaded, cfgs, streams, scale.chunk)
    if jobs:
        timed("speed+streams")

    if "roofline" in sections:
        res["sections"]["roofline"] = _roofline(res, loaded, scale, streams, cfgs, roofline)
        timed("roofline")

    if "batch" in sections:
        if args.model:
            log("batch: the batch section runs the default model only; skipped")
        elif batch_command is None:
            log("batch: no batch command to measure; skipped")
        else:
            from mlxkv.bench import batch

            try:
                b = batch.measure(
                    loaded,
                    scale.batch_prompts,
                    scale.batch_max_tokens,
                    scale.batch_rounds,
                    log,
                    batch_command,
                )
            except Exception as e:  # report, don't abort the run
                log(f"batch: failed ({type(e).__name__}: {e}); skipped")
                res["batch_error"] = f"{type(e).__name__}: {e}"
                b = None
            if b:
                res["sections"]["batch"] = b
        timed("batch")

    res["plots"] = _plots(Path(args.out), streams, cfgs, context, res, scale)
    res["machine"]["load_average_end"] = machine.load_average()
    res["total_seconds"] = time.perf_counter() - t_start
    res["partial"] = False
    return res


def _roofline(res, loaded, scale, streams, cfgs, roofline) -> dict:
    from mlxkv.memory.predictor import predict
    from mlxkv.memory.probe import probe

    layout = loaded.layout or probe(loaded.config)
    bw = roofline.measure_bandwidth(scale.bandwidth_bytes)
    points = []
    eng = res["sections"].get("engine")
    if eng:
        # Average context over the decode: prompt + half the generated tokens.
        ctx = eng["prompt_tokens"] + eng["decode_tokens"] // 2
        kv = predict(layout, ctx, kv_dtype=loaded.dtype).logical
        for side, label in (("mlxkv", "mlxkv engine"), ("mlx_lm", "mlx-lm stream_generate")):
            points.append((f"{label}, {ctx} ctx", eng["median"][side]["decode_tps"], kv))
    for key, r in streams.items():
        cfg = cfgs[key]
        if cfg.policy is None or r.decode_end_tps is None:
            continue
        kv = predict(layout, r.tokens, cfg.policy, kv_dtype=loaded.dtype).logical
        points.append((f"{cfg.label}, after {r.tokens}", r.decode_end_tps, kv))
    return {
        "bandwidth": bw,
        "weights_bytes": loaded.weights_bytes,
        "rows": roofline.rows(bw, loaded.weights_bytes, points),
    }


def _plots(out: Path, streams, cfgs, context, res, scale) -> list[str]:
    from mlxkv.bench import plots

    if not plots.available():
        log(plots.MISSING)
        res["plots_missing"] = plots.MISSING
        return []
    made = []
    labels = {k: f"{cfgs[k].label} ({cfgs[k].side})" for k in cfgs}
    width = max(32, scale.stream_tokens // 64)
    if streams:
        made.append(
            plots.loss_over_position(streams, labels, context, out / "bench-loss.png", width)
        )
        made.append(plots.speed_over_position(streams, labels, out / "bench-stream-speed.png"))
        made.append(plots.kv_memory(streams, labels, out / "bench-kv-bytes.png"))
    roof = res["sections"].get("roofline")
    if roof and roof["rows"]:
        made.append(plots.roofline(roof["rows"], out / "bench-roofline.png"))
    return [p.name for p in made]


def write(res: dict, out: Path) -> Path:
    from mlxkv.bench import report

    (out / "bench-results.json").write_text(json.dumps(res, indent=1, default=float) + "\n")
    path = out / "benchmarks.md"
    previous = path.read_text(encoding="utf-8") if path.is_file() else None
    path.write_text(report.keep_measured_elsewhere(report.render(res), previous))
    return path
