"""Code completion as llama.vim asks for it, against ``mlxkv serve``'s ``/infill``: what
the prefix cache saves as the cursor moves down a file.

    python benchmarks/infill_bench.py [--positions 6] [--chunks 4] [--workdir DIR]
        [--json OUT.json]

The default model has no fill-in-the-middle tokens, so this gives a float32 copy of it
three (Qwen's markers, rows appended to its embeddings): its middles are not code, but
its prefills are the real model's, and prefill is what the cache saves. The "project" is
mlxkv's own source: the file being edited is ``mlxkv/server/app.py``, and llama.vim's ring
of other files' chunks (``--chunks`` of 32 lines, from ``mlxkv/engine/``; llama.vim keeps
up to 16 of 64 lines, sized for a GPU) goes in ``input_extra``, after its warm-up request
(``n_predict: 0``). For each cursor position,
moving down one line at a time: llama.vim's request (256 lines of prefix, the cursor's
line up to its middle, 64 lines of suffix, ``n_predict`` 16 with ``ignore_eos`` so every
answer is as long). Two servers in turn: the prefix cache on (the default) and off
(``--prefix-cache-bytes 0``). Per request: wall time, the tokens prefilled
(``timings.prompt_n``) and reused (``timings.cache_n``).

    python benchmarks/infill_bench.py --cuts

compares where the prefix may start when it is over its 1,536-token budget, with the
tokenizer alone: for llama.vim's requests down 400 lines of three of mlxkv's files, the
tokens each completion must prefill when the one before it is in the prefix cache, and
the prefix tokens kept.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mlxkv.backend import setup_blas

setup_blas()  # the model copy is made with MLX in this process

HERE = Path(__file__).resolve().parents[1]
MARKERS = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]


def fim_copy(dst: Path) -> Path:
    """A float32 copy of the default model with Qwen's three FIM markers added."""
    if (dst / "config.json").is_file():
        return dst
    import mlx.core as mx
    from transformers import AutoTokenizer

    from mlxkv.bench.serve import float32_copy

    base = float32_copy(dst.with_name(dst.name + "-f32"))
    tmp = dst.with_name(dst.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp)
    tok = AutoTokenizer.from_pretrained(str(base))
    tok.add_tokens(MARKERS, special_tokens=True)
    tok.save_pretrained(str(tmp))
    for f in tmp.glob("*.safetensors"):
        weights = mx.load(str(f))
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in weights:  # new rows: the mean embedding
                w = weights[name]
                extra = mx.broadcast_to(w.mean(axis=0), (len(MARKERS), w.shape[1]))
                weights[name] = mx.concatenate([w, extra.astype(w.dtype)])
        mx.save_safetensors(str(f), weights, metadata={"format": "mlx"})
    config = json.loads((tmp / "config.json").read_text())
    config["vocab_size"] = len(tok)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(dst)
    return dst


def ring_chunks(n: int, lines: int = 32) -> list[dict]:
    files = sorted((HERE / "mlxkv" / "engine").glob("*.py"))
    chunks = []
    for f in files:
        text = f.read_text().splitlines()
        if len(text) > lines:
            chunks.append({"filename": str(f.relative_to(HERE)), "text": "\n".join(text[:lines])})
        if len(chunks) == n:
            break
    return chunks


def requests(positions: int, start: int = 300, lines: list[str] | None = None) -> list[dict]:
    """llama.vim's request at each cursor position, moving down one line each time (in
    ``lines``, else mlxkv/server/app.py)."""
    if lines is None:
        lines = (HERE / "mlxkv" / "server" / "app.py").read_text().splitlines()
    out = []
    for i in range(start, min(start + positions, len(lines))):
        line = lines[i]
        cut = len(line) - len(line.lstrip()) + len(line.strip()) // 2
        out.append(
            {
                "input_prefix": "\n".join(lines[max(0, i - 256) : i]) + "\n",
                "prompt": line[:cut],
                "input_suffix": line[cut:] + "\n" + "\n".join(lines[i + 1 : i + 65]),
                "n_predict": 16,
                "ignore_eos": True,
                "temperature": 0,
                "samplers": ["top_k", "top_p", "infill"],
                "cache_prompt": True,
                "t_max_prompt_ms": 500,
            }
        )
    return out


def common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def cut_rules(enc, budget: int) -> dict:
    """Where the prefix may start: llama.cpp's last tokens, the first whole line or the
    earliest blank line that fits, and mlxkv's (``prefix_tail``)."""
    from mlxkv.models.fim import prefix_tail

    def earliest(text: str, anchor) -> list[int] | None:
        at = [i + 1 for i in range(len(text) - 1) if text[i] == "\n" and anchor(text, i + 1)]
        lo, hi = 0, len(at)
        while lo < hi:  # the first that fits (the rest's tokens shrink as the start moves)
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if len(enc(text[at[mid] :])) <= budget else (mid + 1, hi)
        for p in at[lo:]:
            if len(ids := enc(text[p:])) <= budget:
                return ids
        return None

    def rule(anchor):
        def cut(text: str) -> list[int]:
            ids = enc(text)
            return ids if len(ids) <= budget else earliest(text, anchor) or ids[-budget:]

        return cut

    return {
        "last 1,536 tokens (llama.cpp)": lambda t: enc(t)[-budget:],
        "the first whole line that fits": rule(lambda t, p: True),
        "the earliest blank line that fits": rule(lambda t, p: t[p - 2 : p] == "\n\n"),
        "mlxkv: earliest blank line, else smallest CRC-32, within 512 of the budget": (
            lambda t: prefix_tail(enc, t, budget)[0]
        ),
    }


def cut_table(model: Path) -> list[dict]:
    from mlx_lm.utils import load_tokenizer

    from mlxkv.models.fim import INFILL_BATCH

    tok = load_tokenizer(model)

    def enc(t: str) -> list[int]:
        return tok.encode(t, add_special_tokens=False) if t else []

    walks = [("server/app.py", 300, 150), ("engine/scheduler.py", 300, 150)]
    walks.append(("caches/kivi.py", 260, 100))
    rows = []
    for name, cut in cut_rules(enc, 3 * INFILL_BATCH // 4).items():
        prefilled, kept, seconds = [], [], []
        for path, start, n in walks:
            lines = (HERE / "mlxkv" / path).read_text().splitlines()
            last: list[int] = []
            for body in requests(n, start, lines):
                t = time.perf_counter()
                prefix = cut(body["input_prefix"])
                seconds.append(time.perf_counter() - t)
                middle, suffix = enc(body["prompt"]), enc(body["input_suffix"])
                suffix = suffix[: INFILL_BATCH // 4 - 2 - len(middle)]
                ids = [-1, *prefix, *middle, -2, *suffix, -3]  # the markers
                prefilled.append(len(ids) - common(last, ids))
                kept.append(len(prefix))
                last = ids
        rows.append(
            {
                "rule": name,
                "requests": len(prefilled),
                "prefilled_mean": round(statistics.mean(prefilled)),
                "prefilled_median": statistics.median(prefilled),
                "kept_mean": round(statistics.mean(kept)),
                "kept_min": min(kept),
                "cut_ms_median": round(1000 * statistics.median(seconds), 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def run(
    model: Path, workdir: Path, positions: int, chunks: int, serve_args: list[str]
) -> list[dict]:
    import httpx

    from mlxkv.bench.serve import ServerProcess, free_port

    port = free_port()
    cmd = [sys.executable, "-m", "mlxkv", "serve", str(model), "--port", str(port)]
    cmd += ["--no-access-log", "--force", "--prefix-cache-dir", str(workdir / "pc"), *serve_args]
    shutil.rmtree(workdir / "pc", ignore_errors=True)
    server = ServerProcess("mlxkv serve", cmd, port, workdir / "serve.log", "")
    rows = []
    try:
        server.wait_ready()
        extra = ring_chunks(chunks)
        with httpx.Client(base_url=server.url, timeout=600) as http:
            warm = {"input_prefix": "", "input_suffix": "", "input_extra": extra}
            http.post("/infill", json={**warm, "n_predict": 0}).raise_for_status()
            for body in requests(positions):
                t = time.perf_counter()
                r = http.post("/infill", json={**body, "input_extra": extra})
                r.raise_for_status()
                out = r.json()
                rows.append(
                    {
                        "seconds": time.perf_counter() - t,
                        "prompt_tokens": out["tokens_evaluated"],
                        "prefilled": out["timings"]["prompt_n"],
                        "reused": out["timings"]["cache_n"],
                        "truncated": out["truncated"],
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    finally:
        server.stop()
    return rows


def summary(rows: list[dict]) -> dict:
    return {
        "requests": len(rows),
        "median_s": round(statistics.median(r["seconds"] for r in rows), 3),
        "median_prompt_tokens": statistics.median(r["prompt_tokens"] for r in rows),
        "median_prefilled": statistics.median(r["prefilled"] for r in rows),
        "median_reused": statistics.median(r["reused"] for r in rows),
        "total_s": round(sum(r["seconds"] for r in rows), 1),
        "total_prefilled": sum(r["prefilled"] for r in rows),
        "truncated": sum(r["truncated"] for r in rows),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--positions", type=int, default=6)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mlxkv-infill")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--cuts", action="store_true", help="compare prefix cuts (tokenizer only)")
    args = p.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.cuts:
        from mlxkv.models.resolve import resolve

        rows = cut_table(resolve(None).path)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
        return
    model = fim_copy(args.workdir / "smollm2-fim")
    result = {}
    for name, flags in (("prefix cache on", []), ("off", ["--prefix-cache-bytes", "0"])):
        result[name] = summary(run(model, args.workdir, args.positions, args.chunks, flags))
        print(name, json.dumps(result[name]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
