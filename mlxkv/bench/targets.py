"""The benchmark targets, each turned into (target, measured value, met?) from a results dict.

A target whose inputs were not measured in this run (a section skipped, a stream too short
to pass the context in --quick) is reported as not measured, never as met.
"""

from __future__ import annotations

from mlxkv.memory.dtypes import dtype_bytes


def _pair(res, key):
    for p in res["sections"].get("speed", {}).get("pairs", []):
        if p["mlxkv"] == key:
            return p
    return None


def _checkpoint(res, key, tokens=None):
    s = res["sections"].get("streams", {}).get(key)
    if not s or not s["checkpoints"]:
        return None
    if tokens is None:
        return s["checkpoints"][-1]
    return next((c for c in s["checkpoints"] if c["tokens"] == tokens), None)


def _row(name, target, measured, met, note=""):
    return {"target": name, "goal": target, "measured": measured, "met": met, "note": note}


def evaluate(res) -> list[dict]:
    rows = []
    sec = res["sections"]
    eng = sec.get("engine")
    if eng:
        r = eng["ratio"]["decode_tps"]
        m = eng["median"]
        rows.append(_row(
            "engine decode vs mlx-lm stream_generate", ">= 0.98x", f"{r:.3f}x "
            f"({m['mlxkv']['decode_tps']:.2f} vs {m['mlx_lm']['decode_tps']:.2f} tok/s)",
            r >= 0.98,
        ))  # fmt: skip
    for key, peer in (("sink-window", "RotatingKVCache keep=4"), ("window", "keep=0")):
        p = _pair(res, key)
        if p:
            ok = p["decode_ratio"] >= 0.98 and p["prefill_ratio"] >= 0.98
            rows.append(_row(
                f"{key} speed vs mlx-lm {peer}", ">= 0.98x",
                f"decode {p['decode_ratio']:.3f}x, prefill {p['prefill_ratio']:.3f}x", ok,
            ))  # fmt: skip
    s = sec.get("streams", {}).get("sink-window")
    if s:
        f = s["flatness"]
        ok = f["last_over_first"] >= 0.95 and f["decode_end_over_start"] >= 0.95
        rows.append(_row(
            f"sink+window flat over tokens {f.get('from_token', 0)}-{s['tokens']}",
            "last 10% within 5% of first 10%",
            f"prefill {f['last_over_first']:.3f}x ({f['first10_tps']:.1f} -> "
            f"{f['last10_tps']:.1f} tok/s); decode end/start {f['decode_end_over_start']:.3f}x",
            ok,
        ))  # fmt: skip
    full, q4 = _checkpoint(res, "full"), _checkpoint(res, "4bit")
    if full and q4:
        common = {c["tokens"] for c in sec["streams"]["full"]["checkpoints"]} & {
            c["tokens"] for c in sec["streams"]["4bit"]["checkpoints"]
        }
        t = max(common)
        full, q4 = _checkpoint(res, "full", t), _checkpoint(res, "4bit", t)
        b = dtype_bytes(res["model"]["dtype"])
        ratio = q4["kv_bytes"] / full["kv_bytes"]
        fp16 = ratio * b / 2  # the same cache if the activations were fp16
        rows.append(_row(
            "4-bit KV bytes vs fp16", "~0.28x",
            f"{fp16:.3f}x fp16 ({ratio:.3f}x the {res['model']['dtype']} cache, {t} tokens)",
            abs(fp16 - 0.28) <= 0.02,
            "scales/biases are stored in the activation dtype: float32 on the CPU",
        ))  # fmt: skip
        rows.append(_row(
            f"4-bit peak at a {t}-token prompt", "<= unquantized peak",
            f"MLX peak {q4['mlx_peak'] / 2**20:.0f} vs {full['mlx_peak'] / 2**20:.0f} MiB; "
            f"process {_mib(q4['process_peak'])} vs {_mib(full['process_peak'])} MiB",
            q4["mlx_peak"] <= full["mlx_peak"],
        ))  # fmt: skip
    b = sec.get("batch")
    if b:
        r = b["ratio_vs_one_by_one"]
        rows.append(_row(
            "mlxkv batch vs one by one", ">= 3x",
            f"{r:.2f}x ({b['median_tps']['mlxkv_batch']:.1f} vs "
            f"{b['median_tps']['one_by_one']:.1f} tok/s; mlx-lm batch_generate "
            f"{b['median_tps']['mlx_lm_batch_generate']:.1f})", r >= 3,
        ))  # fmt: skip
    roof = sec.get("roofline")
    if roof and roof["rows"]:
        row = roof["rows"][0]
        rows.append(_row(
            "decode vs memory-bandwidth bound", ">= 60%",
            f"{100 * row['fraction']:.0f}% ({row['what']}: {row['decode_tps']:.2f} of "
            f"{row['bound_tps']:.2f} tok/s)", row["fraction"] >= 0.6,
        ))  # fmt: skip
    q = sec.get("quality", {})
    if "sink-window" in q and "full" in q:
        past, below = q["sink-window"]["ppl_past_context"], q["full"]["ppl_below_context"]
        ctx = res["model"]["context"]
        if past is None:
            rows.append(_row(
                f"sink+window ppl past {ctx} vs full below it", "within 5%", "not measured",
                None, "the stream does not pass the context (--quick)",
            ))  # fmt: skip
        else:
            r = past / below
            rows.append(_row(
                f"sink+window ppl past {ctx} vs full below it", "within 5%",
                f"{past:.2f} vs {below:.2f} ({r:.3f}x)", r <= 1.05,
            ))  # fmt: skip
    return rows


def _mib(b):
    return "?" if b is None else f"{b / 2**20:.0f}"
