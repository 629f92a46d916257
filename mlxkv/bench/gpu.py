"""The GPU benchmark: mlxkv's caches against mlx-lm's on a Llama-3.1-8B-shaped model.

The model is mlx-lm's llama built from Llama-3.1-8B's published config (random weights:
nothing is downloaded; speed and memory depend on shapes, not values), in bfloat16 and in
MLX 4-bit (``nn.quantize``, group 64: what ``mlx_lm.convert -q`` writes). For each weight
format, context and policy, mlxkv's cache and its mlx-lm counterpart
(:mod:`mlxkv.bench.configs`: ``KVCache``, ``RotatingKVCache(keep=4)``,
``QuantizedKVCache``) run interleaved, round after round (the order alternating), each
run a fresh cache:

* prefill: ``context`` random tokens in chunks of 512 (sink caches take the engine's
  smaller chunks once evicting), the caches evaluated after each chunk and the logits not
  (as mlx-lm's ``generate_step`` prefills);
* decode: ``decode`` greedy tokens, one model call each, the next step queued before the
  last is read (``mx.async_eval``, as ``generate_step``), after one untimed step (which
  takes the cache's next allocation step, and on CUDA a new cuDNN graph, out of the timing);
* decode as a fraction of the bandwidth bound: (weight bytes + the cache's bytes) per
  token over a measured device copy bandwidth (:func:`copy_bandwidth`);
* MLX's peak memory in mlxkv's first run against what ``plan`` predicts for the same
  model, context and policy (weights + KV + activations + logits: the parts MLX
  allocates; ``plan``'s fixed runtime overhead is outside MLX's counter). Both weight
  formats stay loaded (so each context runs for both before the next, longer one), so the
  peak counts what the run allocated above what was held before it, plus its model's
  weights;
* batch: 16 rows prefilled alone at the shortest context (if at most 4,096), merged,
  decoded together (mlxkv's batched caches), against one row at a time (the single
  decode above).

Before its first timed run, each cache of each side runs once untimed over the window
and two chunks more (a GPU backend compiles its kernels at their first use). With a
``budget`` in seconds, no row starts after it is spent: the rows left are listed as
skipped, and ``progress`` gets the report after every row (a run cut short keeps them).

:func:`measure_peak` runs one cache alone and reports its peak after the prefill and after
decoding (``benchmarks/gpu_peak.py``: one process per MLX setting).

``quick`` is a tiny model of the same family (2 layers, hidden 128, head_dim 64) at contexts
256 and 1,024, 4 decode tokens, 2 rows in the batch: small enough for a CPU run in seconds
(bfloat16 and quantized matmuls have no CPU fast path), a smoke run of this very code.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from mlxkv.errors import UserError
from mlxkv.memory.policy_bytes import STEP

LLAMA31_8B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
QUICK = dict(
    LLAMA31_8B,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    intermediate_size=256,
    vocab_size=512,
)
POLICIES = ("full", "sink-window", "4bit", "8bit", "sink-4bit", "4bit-plain")
WEIGHTS = ("bf16", "q4")
CONTEXTS = (4096, 32768, 131072)
QUICK_CONTEXTS = (256, 1024)
KEPT, SINKS = 4096, 4  # bounded caches keep sink 4 + window 4092
QUICK_KEPT = 128
CHUNK = 512
BATCH = 16
BATCH_MAX_CONTEXT = 4096  # 16 full rows of 128k would not fit a GPU: batch at short contexts
GROUP_SIZE = 64  # weights, as mlx_lm.convert -q
SIDES = ("mlxkv", "mlx-lm")


@dataclass
class Settings:
    config: dict
    contexts: tuple[int, ...]
    policies: tuple[str, ...]
    weights: tuple[str, ...]
    kept: int
    decode: int = 32
    rounds: int = 2
    batch: int = BATCH
    device: str = "gpu"
    label: str = "Llama-3.1-8B shape"
    warmup: int = KEPT + 2 * CHUNK  # tokens of the untimed first run of each cache
    budget: float | None = None  # seconds after which no row starts
    # tokens per prefill call into an evicting sink cache: each sink row runs once per
    # size named, in one process (one model build); none named: the engine's
    sink_chunks: tuple[int, ...] = ()


@dataclass
class Row:
    weights: str
    context: int
    policy: str
    label: str
    peer_label: str
    prefill: dict = field(default_factory=dict)  # side -> [tok/s per round]
    decode: dict = field(default_factory=dict)
    kv_bytes: dict = field(default_factory=dict)  # side -> cache bytes after decoding
    peak: int | None = None  # MLX peak in mlxkv's first run
    plan: dict | None = None  # plan's parts for the same setting
    batch_tps: float | None = None  # 16 rows decoded together, tokens/s over all rows
    errors: dict = field(default_factory=dict)  # side -> what MLX raised (no kernel, say)
    sink_chunk: int | None = None  # tokens per call into an evicting sink cache (None: 64)


def settings(
    quick: bool,
    contexts=None,
    policies=None,
    weights=None,
    device: str = "gpu",
    decode=None,
    rounds=None,
    budget=None,
    sink_chunks=None,
) -> Settings:
    bad = [p for p in policies or () if p not in POLICIES]
    if bad:
        raise UserError(f"--policies: unknown {bad[0]}; choose from {', '.join(POLICIES)}")
    bad = [w for w in weights or () if w not in WEIGHTS]
    if bad:
        raise UserError(f"--weights: unknown {bad[0]}; choose from {', '.join(WEIGHTS)}")
    if device not in ("gpu", "cpu"):
        raise UserError(f"--device must be gpu or cpu, got {device}")
    s = Settings(
        config=QUICK if quick else LLAMA31_8B,
        contexts=tuple(contexts or (QUICK_CONTEXTS if quick else CONTEXTS)),
        policies=tuple(policies or POLICIES),
        weights=tuple(weights or WEIGHTS),
        kept=QUICK_KEPT if quick else KEPT,
        decode=decode or (4 if quick else 32),
        rounds=rounds or (1 if quick else 2),
        batch=2 if quick else BATCH,
        device=device,
        label="tiny llama (quick)" if quick else "Llama-3.1-8B shape",
        warmup=0 if quick else KEPT + 2 * CHUNK,  # a CPU compiles nothing worth warming
        budget=budget,
        sink_chunks=tuple(sink_chunks or ()),
    )
    if any(c <= 0 for c in s.contexts):
        raise UserError("--contexts must be positive token counts")
    if budget is not None and budget <= 0:
        raise UserError("--budget must be a positive number of seconds")
    if any(not 0 < n <= CHUNK for n in s.sink_chunks):
        raise UserError(f"--sink-chunk must be 1 to {CHUNK} tokens (a prefill call's most)")
    if not 0 < s.decode < STEP:
        raise UserError(f"--decode must be 1 to {STEP - 1} tokens, within one allocation step")
    return s


def use_device(device: str) -> str:
    """Make ``device`` MLX's default; returns the backend name the plan should use."""
    import mlx.core as mx

    if device == "cpu":
        mx.set_default_device(mx.cpu)
        return "cpu"
    if mx.metal.is_available():
        mx.set_default_device(mx.gpu)
        return "metal"
    if mx.cuda.is_available():
        mx.set_default_device(mx.gpu)
        return "cuda"
    raise UserError("--device gpu: MLX sees no GPU here (install mlx-cuda-13, or use --device cpu)")


def build(config: dict, weights: str):
    """mlx-lm's llama from ``config``, random weights, bfloat16, packed 4-bit for ``q4``."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))  # lazy: nothing allocated yet
    model.set_dtype(mx.bfloat16)
    if weights == "q4":
        nn.quantize(model, group_size=GROUP_SIZE, bits=4)
    for _, v in tree_flatten(model.parameters()):  # one at a time: no float32 copy of all
        mx.eval(v)
    return model


def weight_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Device copy bandwidth, bytes/s: the best of a few copies of ``nbytes`` (read + write
    counted, as a bandwidth test reports them)."""
    import mlx.core as mx

    a = mx.ones((nbytes // 4,), dtype=mx.float32)
    mx.eval(a)
    best = float("inf")
    for _ in range(repeats):
        tic = time.perf_counter()
        b = a + 1  # one read, one write
        mx.eval(b)
        best = min(best, time.perf_counter() - tic)
        del b
    return 2 * a.nbytes / best


def _prefill(model, caches, ids, evicting=None) -> float:
    from mlxkv.engine.scheduler import prefill

    tic = time.perf_counter()
    prefill(model, caches, ids, 0, len(ids), CHUNK, evicting)
    return len(ids) / (time.perf_counter() - tic)


def _decode(model, caches, first: int, n: int, rows: int = 1) -> float:
    """Greedy decode tok/s (over all rows), each step queued before the last is read, after
    one untimed step: the first step past a prefill (contexts of whole allocation steps)
    takes the cache's next step (a new buffer size, for which MLX's CUDA backend builds a
    new cuDNN graph), which the ``n`` timed steps (fewer than ``STEP``) then do not cross."""
    import mlx.core as mx

    def step(y):
        return mx.argmax(model(y, cache=caches)[:, -1], axis=-1, keepdims=True)

    y = step(mx.array([[first]] * rows))
    mx.eval(y, [c.state for c in caches])
    tic = time.perf_counter()
    for _ in range(n):
        y = step(y)
        mx.async_eval(y)
    mx.eval(y, [c.state for c in caches])
    return rows * n / (time.perf_counter() - tic)


def _run(model, factory, ids, decode: int, evicting=None) -> tuple[float, float, int]:
    import mlx.core as mx

    caches = factory()
    p = _prefill(model, caches, ids, evicting)
    d = _decode(model, caches, ids[-1], decode)
    nbytes = sum(c.nbytes for c in caches)
    del caches
    mx.clear_cache()
    return p, d, nbytes


def plan_parts(config: dict, weights: str, policy, context: int, on: str) -> dict:
    """What ``plan`` predicts for this model (by its config), context and policy."""
    from mlxkv.memory.estimate import estimate_model
    from mlxkv.memory.source import ModelSource

    src = ModelSource("gpu bench", config, None, None, "benchmark config")
    est = estimate_model(
        src,
        policy,
        context=context,
        chunk=CHUNK,
        kv_dtype="bfloat16",
        memory="1TB" if on != "metal" else "1024GB",
        search=False,
        on="cuda" if on == "cpu" else on,  # the model is built as a GPU runs it
        weight_bits=4 if weights == "q4" else None,
    )
    b = est.budget
    parts = {
        "weights": b.weights.bytes,
        "kv": b.kv.peak_allocated,
        "activations": b.runtime.activation_bytes,
        "logits": b.runtime.logits_bytes,
    }
    parts["mlx"] = sum(parts.values())
    parts["total"] = b.total
    parts["fused_attention"] = b.runtime.fused_attention
    return parts


def _batch_tps(model, factory, ids, decode: int, rows: int, evicting=None) -> float:
    import mlx.core as mx

    from mlxkv.caches.batched import merge_rows

    singles = []
    for r in range(rows):
        caches = factory()
        # rows of the same length, other tokens
        _prefill(model, caches, ids[r:] + ids[:r], evicting)
        singles.append(caches)
    batched = merge_rows(singles)
    del singles
    tps = _decode(model, batched, ids[-1], decode, rows)
    del batched
    mx.clear_cache()
    return tps


def run(s: Settings, log=print, progress=None) -> dict:
    import mlx.core as mx

    from mlxkv.bench.configs import all_configs

    start = time.perf_counter()
    on = use_device(s.device)
    load_before = _loadavg()
    configs = all_configs(s.kept, SINKS)
    bandwidth = copy_bandwidth((1 << 30) if s.device == "gpu" else (256 << 20))
    log(f"device copy bandwidth {bandwidth / 1e9:.1f} GB/s ({on})")
    models, weight_sizes = {}, {}
    for w in s.weights:
        models[w] = build(s.config, w)
        weight_sizes[w] = weight_bytes(models[w])
        log(f"{s.label}, {w}: {weight_sizes[w] / 2**30:.2f} GiB of weights")
    warmed: dict = {}  # (weights, cache label, chunk) -> what its first run raised, or None
    rows: list[Row] = []
    skipped: list[dict] = []

    def finish() -> dict:
        result = report(s, rows, bandwidth, weight_sizes, on)
        info = mx.device_info()
        result["device_info"] = {k: v for k, v in info.items() if isinstance(v, str | int)}
        result["mlx_version"] = mx.__version__
        result["loadavg"] = [load_before, _loadavg()]
        result["skipped"] = skipped
        result["seconds"] = round(time.perf_counter() - start, 1)
        return result

    for context in s.contexts:
        ids = _tokens(context, context, s.config)
        for w in s.weights:
            model = models[w]
            for key in s.policies:
                ours = configs[key]
                for chunk in s.sink_chunks if ours.policy.sinks and s.sink_chunks else (None,):
                    if s.budget is not None and time.perf_counter() - start > s.budget:
                        skipped.append(
                            {"weights": w, "context": context, "policy": key, "sink_chunk": chunk}
                        )
                        continue
                    peer = configs[ours.peer]
                    label = ours.label + (f", evicting chunks of {chunk}" if chunk else "")
                    row = Row(w, context, key, label, peer.label, sink_chunk=chunk)
                    row.plan = plan_parts(s.config, w, ours.policy, context, on)
                    _measure(s, row, model, weight_sizes[w], ids, ours, peer, warmed)
                    log(_line(row))
                    rows.append(row)
                    if progress is not None:
                        progress(finish())
    if skipped:
        log(f"budget of {s.budget:g} s spent: {len(skipped)} row(s) skipped")
    return finish()


def _measure(s: Settings, row: Row, model, weight_nbytes: int, ids, ours, peer, warmed: dict):
    """Fill ``row``: mlxkv's cache and its mlx-lm peer over ``ids``, interleaved round after
    round, each cache's first use (per sink chunk) untimed and recorded in ``warmed``."""
    import mlx.core as mx

    w, chunk, context = row.weights, row.sink_chunk, row.context

    def warm_key(cfg):  # the chunk size changes only mlxkv's shapes
        return w, cfg.label, chunk if cfg is ours else None

    for side in SIDES:
        row.prefill[side], row.decode[side] = [], []
    for cfg in (ours, peer):  # the kernels' first use, for this chunk size too
        if s.warmup and warm_key(cfg) not in warmed:
            warm_ids = _tokens(0, s.warmup, s.config)
            _, warmed[warm_key(cfg)] = _attempt(_run, model, cfg.factory(model), warm_ids, 2, chunk)
    for r in range(s.rounds):
        sides = [("mlxkv", ours), ("mlx-lm", peer)]
        for side, cfg in sides if r % 2 == 0 else sides[::-1]:
            failed = warmed.get(warm_key(cfg))
            if failed or side in row.errors:
                row.errors.setdefault(side, failed)
                continue
            first = side == "mlxkv" and row.peak is None
            if first:
                mx.clear_cache()
                mx.reset_peak_memory()
                held = mx.get_active_memory()
            got, error = _attempt(_run, model, cfg.factory(model), ids, s.decode, chunk)
            if error:
                row.errors[side] = error
                continue
            p, d, kv = got
            if first:  # above what was held, plus this run's own weights
                row.peak = mx.get_peak_memory() - held + weight_nbytes
            row.prefill[side].append(p)
            row.decode[side].append(d)
            row.kv_bytes[side] = kv
    batch_here = context == min(s.contexts) <= BATCH_MAX_CONTEXT and s.batch > 1
    if batch_here and "mlxkv" not in row.errors:
        row.batch_tps, error = _attempt(
            _batch_tps, model, ours.factory(model), ids, s.decode, s.batch, chunk
        )
        if error:
            row.errors["batch"] = error


PEAK_ENV = (  # MLX's settings that decide how long a GPU backend holds freed buffers
    "MLX_MAX_OPS_PER_BUFFER",
    "MLX_MAX_MB_PER_BUFFER",
    "MLX_USE_CUDA_GRAPHS",
    "MLX_CUDA_USE_CUDNN_SDPA",
)


def measure_peak(
    s: Settings, weights: str, context: int, policy: str, side: str, presize: bool
) -> dict:
    """MLX's peak while one cache prefills ``context`` tokens and decodes ``s.decode``, over
    what ``plan`` predicts: one setting per process, so that MLX's environment settings
    (``PEAK_ENV``, read once at start) can differ between runs. The peak counts what the run
    allocated above what was held before it, plus the weights, as :func:`run` counts it.
    ``presize``: a full cache (either side) gets buffers for the whole run before the
    prefill, so the excess that remains is not the cache's growth."""
    import os

    import mlx.core as mx

    from mlxkv.bench.configs import all_configs
    from mlxkv.memory.policy_bytes import round_up

    if presize and policy != "full":
        raise UserError("--presize: only the full cache can be sized before its prefill")
    on = use_device(s.device)
    configs = all_configs(s.kept, SINKS)
    ours = configs[policy]
    cfg = ours if side == "mlxkv" else configs[ours.peer]
    model = build(s.config, weights)
    nbytes = weight_bytes(model)
    if s.warmup:  # the kernels' first use, outside the measured run
        _run(model, cfg.factory(model), _tokens(0, s.warmup, s.config), 2)
    ids = _tokens(context, context, s.config)  # the benchmark's prompt at this context
    mx.clear_cache()
    mx.reset_peak_memory()
    held = mx.get_active_memory()
    caches = cfg.factory(model)()
    if presize:
        shape = (1, s.config["num_key_value_heads"], round_up(context + s.decode + 1))
        for c in caches:
            c.keys = mx.zeros((*shape, s.config["head_dim"]), mx.bfloat16)
            c.values = mx.zeros((*shape, s.config["head_dim"]), mx.bfloat16)
        mx.eval([(c.keys, c.values) for c in caches])
    _prefill(model, caches, ids)
    after_prefill = mx.get_peak_memory() - held + nbytes
    _decode(model, caches, ids[-1], s.decode)
    top = mx.get_peak_memory() - held + nbytes
    kv = sum(c.nbytes for c in caches)
    plan = plan_parts(s.config, weights, ours.policy, context, on)
    return {
        "device": on,
        "device_name": mx.device_info().get("device_name"),
        "mlx_version": mx.__version__,
        "env": {k: os.environ[k] for k in PEAK_ENV if k in os.environ},
        "weights": weights,
        "context": context,
        "policy": policy,
        "side": side,
        "cache": cfg.label,
        "presize": presize,
        "kv_bytes": kv,
        "peak_after_prefill": after_prefill,
        "peak_bytes": top,
        "plan": plan,
        "peak_over_plan": top / plan["mlx"],
        "excess_over_kv": (top - plan["mlx"]) / kv,
    }


def _tokens(seed: int, n: int, config: dict) -> list[int]:
    """``n`` random token ids, the same for the same seed (the warm-up run's, a context's)."""
    import random

    return random.Random(seed).choices(range(config["vocab_size"]), k=n)


def _attempt(step, *args):
    """``(step(*args), None)``, or ``(None, what MLX raised)`` (its first line). A backend
    may lack a kernel for one cache's shapes (MLX's CUDA ``quantized_matmul``, say): the
    row says so and the benchmark goes on."""
    import mlx.core as mx

    try:
        return step(*args), None
    except (RuntimeError, ValueError) as e:
        mx.clear_cache()
        return None, (str(e).splitlines() or [type(e).__name__])[0]


def _loadavg() -> str | None:
    """The 1-minute load average (what the other work on the machine was doing)."""
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return None


def _med(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def _line(r: Row) -> str:
    d = {k: _med(v) for k, v in r.decode.items()}
    p = {k: _med(v) for k, v in r.prefill.items()}
    line = (
        f"{r.weights} {r.context:>7} {r.policy:<12}"
        + (f" chunk {r.sink_chunk}" if r.sink_chunk else "")
        + f" decode {d['mlxkv']:.1f} vs "
        f"{d['mlx-lm']:.1f} tok/s, prefill {p['mlxkv']:.0f} vs {p['mlx-lm']:.0f} tok/s"
    )
    return line + "".join(f"; {side} failed: {e}" for side, e in r.errors.items())


def _cell(values: dict, fmt: str) -> str:
    """``mlxkv / mlx-lm``, a side that failed shown as ``fails``."""
    return " / ".join(format(values[k], fmt) if k in values else "fails" for k in SIDES)


def report(s: Settings, rows: list[Row], bandwidth: float, weight_sizes: dict, on: str) -> dict:
    from mlxkv.caches.streaming import SINK_PREFILL_CHUNK

    out = []
    for r in rows:
        w = weight_sizes[r.weights]
        dec = {k: _med(v) for k, v in r.decode.items() if v}
        pre = {k: _med(v) for k, v in r.prefill.items() if v}
        both = len(dec) == 2
        bound = bandwidth / (w + r.kv_bytes["mlxkv"]) if "mlxkv" in dec else None
        out.append(
            {
                "weights": r.weights,
                "context": r.context,
                "policy": r.policy,
                "sink_chunk": r.sink_chunk,
                "label": r.label,
                "mlx_lm": r.peer_label,
                "prefill_tps": pre,
                "decode_tps": dec,
                "decode_ratio": dec["mlxkv"] / dec["mlx-lm"] if both else None,
                "prefill_ratio": pre["mlxkv"] / pre["mlx-lm"] if both else None,
                "kv_bytes": r.kv_bytes,
                "weight_bytes": w,
                "bound_tps": bound,
                "bound_fraction": dec["mlxkv"] / bound if bound else None,
                "errors": r.errors,
                "peak_bytes": r.peak,
                "plan": r.plan,
                "peak_over_plan": r.peak / r.plan["mlx"] if r.peak and r.plan else None,
                "batch": s.batch if r.batch_tps else None,
                "batch_tps": r.batch_tps,
                "batch_speedup": r.batch_tps / dec["mlxkv"] if r.batch_tps else None,
                "rounds": {"prefill": r.prefill, "decode": r.decode},
            }
        )
    return {
        "model": s.label,
        "config": s.config,
        "device": on,
        "bandwidth_bytes_per_s": bandwidth,
        "contexts": list(s.contexts),
        "decode_tokens": s.decode,
        "rounds": s.rounds,
        "warmup_tokens": s.warmup,
        "kept": s.kept,
        "sinks": SINKS,
        "sink_chunk": SINK_PREFILL_CHUNK,  # the engine's, where a row names none
        "rows": out,
    }


def size_text(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def markdown(result: dict) -> str:
    """The result as a markdown table (tok/s medians over rounds)."""
    bw = result["bandwidth_bytes_per_s"] / 1e9
    name = result.get("device_info", {}).get("device_name", "")
    load = result.get("loadavg") or [None, None]
    batch_rows = max((r["batch"] or 0 for r in result["rows"]), default=0)
    lines = [
        f"{result['model']} on {result['device']} ({name}, mlx {result.get('mlx_version')}), "
        f"device copy {bw:.1f} GB/s, {result['decode_tokens']} decode tokens, "
        f"{result['rounds']} round(s), load average {load[0]} at the start, {load[1]} at the end",
        f"Sink caches, once evicting, prefill {result['sink_chunk']} tokens per call where "
        f"their row names no other size; every other cache {CHUNK}.",
        "",
        "| weights | context | policy (mlx-lm peer) | prefill tok/s | decode tok/s | "
        "decode ratio | of bound | batch x | peak / plan |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    failed = []
    for r in result["rows"]:
        batch = f"{r['batch_speedup']:.1f}" if r["batch_speedup"] else ""
        ratio = f"{r['decode_ratio']:.2f}" if r["decode_ratio"] else ""
        bound = f"{r['bound_fraction']:.0%}" if r["bound_fraction"] else ""
        peak_cell = ""
        if r["peak_over_plan"]:
            peak_cell = f"{size_text(r['peak_bytes'])} / {size_text(r['plan']['mlx'])}"
            peak_cell += f" ({r['peak_over_plan']:.3f})"
        lines.append(
            f"| {r['weights']} | {r['context']:,} | {r['label']} ({r['mlx_lm']}) | "
            f"{_cell(r['prefill_tps'], '.0f')} | {_cell(r['decode_tps'], '.1f')} | "
            f"{ratio} | {bound} | {batch} | {peak_cell} |"
        )
        failed += [
            f"{r['weights']} {r['context']:,} {r['label'] if side == 'mlxkv' else r['mlx_lm']}"
            f" ({side}): {e}"
            for side, e in r.get("errors", {}).items()
        ]
    lines += [
        "",
        "prefill and decode: mlxkv / mlx-lm. decode ratio: mlxkv / mlx-lm. of bound: mlxkv's "
        "decode over (device copy bandwidth / (weight bytes + KV bytes) per token). batch x: "
        f"{batch_rows or ''} rows decoded together over one row, tokens/s. peak / plan: "
        "MLX's peak memory in mlxkv's first run (above what "
        "was held before it, plus its weights) over plan's weights + KV + activations + "
        "logits.",
    ]
    if failed:
        lines += ["", "Failed runs (what MLX raised):", ""] + [f"- {x}" for x in failed]
    if result.get("skipped"):
        left = ", ".join(
            f"{x['weights']} {x['context']:,} {x['policy']}"
            + (f" (chunks of {x['sink_chunk']})" if x.get("sink_chunk") else "")
            for x in result["skipped"]
        )
        lines += ["", f"Not run (the --budget was spent): {left}."]
    return "\n".join(lines) + "\n"
