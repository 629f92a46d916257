"""A client's wait while a batch (/v1/batches) runs, by the batch's requests in flight.

    python benchmarks/batch_share.py [--shares 16,15,12] [--lines 48] [--max-tokens 96]
        [--clients 6] [--max-batch 16] [--workdir DIR]

For each ``--batch-requests`` value a fresh ``mlxkv serve`` (default model, ``--max-batch``
16) runs one batch of ``--lines`` completions of ``--max-tokens`` tokens each (EOS ignored,
so every line is as long); once it runs, ``--clients`` chat requests are streamed one after
another, each a second after the last ended: their time to the first token and to the end.
Then the batch's own time and tokens per second. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def one(share: int, args, workdir: Path) -> dict:
    import openai

    from mlxkv.bench.serve import ServerProcess, free_port

    port = free_port()
    folder = workdir / f"share{share}"
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "mlxkv", "serve", "--port", str(port), "--max-batch"]
    cmd += [str(args.max_batch), "--batch-requests", str(share), "--files-dir", str(folder)]
    cmd += ["--prefix-cache-dir", "none", "--conversation-dir", "none"]
    server = ServerProcess("mlxkv", cmd, port, folder / "server.log", "smollm2-135m")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        ask = {"model": server.model, "max_tokens": 8, "temperature": 0}
        client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **ask)
        lines = [
            {
                "custom_id": f"l{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {
                    "prompt": f"Chapter {i}. It was a cold morning when",
                    "max_tokens": args.max_tokens,
                    "ignore_eos": True,
                    "temperature": 0,
                },
            }
            for i in range(args.lines)
        ]
        data = "".join(json.dumps(x) + "\n" for x in lines).encode()
        uploaded = client.files.create(file=("lines.jsonl", data), purpose="batch")
        start = time.perf_counter()
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
        )
        time.sleep(2.0)  # the batch's rows are decoding
        firsts, wholes = [], []
        for i in range(args.clients):
            t0 = time.perf_counter()
            first = None
            stream = client.chat.completions.create(
                messages=[{"role": "user", "content": f"Name a city, {i}."}],
                stream=True,
                **{**ask, "max_tokens": 16},
            )
            for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - t0
            firsts.append(first)
            wholes.append(time.perf_counter() - t0)
            time.sleep(1.0)
        while batch.status not in ("completed", "failed", "cancelled", "expired"):
            time.sleep(0.2)
            batch = client.batches.retrieve(batch.id)
        took = time.perf_counter() - start
        return {
            "batch_requests": share,
            "batch_status": batch.status,
            "client_first_token_s": [round(x, 3) for x in firsts],
            "client_whole_s": [round(x, 3) for x in wholes],
            "batch_s": round(took, 2),
            "batch_tokens_per_s": round(batch.usage.output_tokens / took, 1),
        }
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shares", default="16,15,12", help="--batch-requests values to compare")
    p.add_argument("--lines", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument(
        "--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mlxkv-batch-share"
    )
    args = p.parse_args()
    print(f"load average at the start: {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    for share in (int(s) for s in args.shares.split(",")):
        row = one(share, args, args.workdir)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(
        "\n| --batch-requests | client first token, median (max) | client answer, median "
        "| batch time | batch tokens/s |\n|---|---|---|---|---|"
    )
    for r in rows:
        f, w = r["client_first_token_s"], r["client_whole_s"]
        print(
            f"| {r['batch_requests']} | {statistics.median(f):.2f} s ({max(f):.2f} s) | "
            f"{statistics.median(w):.2f} s | {r['batch_s']:.1f} s | {r['batch_tokens_per_s']} |"
        )


if __name__ == "__main__":
    main()
