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


def requests(positions: int, start: int = 300) -> list[dict]:
    """llama.vim's request at each cursor position, moving down one line each time."""
    lines = (HERE / "mlxkv" / "server" / "app.py").read_text().splitlines()
    out = []
    for i in range(start, start + positions):
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
    args = p.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = fim_copy(args.workdir / "smollm2-fim")
    result = {}
    for name, flags in (("prefix cache on", []), ("off", ["--prefix-cache-bytes", "0"])):
        result[name] = summary(run(model, args.workdir, args.positions, args.chunks, flags))
        print(name, json.dumps(result[name]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
