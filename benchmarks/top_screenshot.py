"""Save an SVG of ``mlxkv top`` watching a running server (for docs/serve.md).

    mlxkv serve --port 8080 --memory 2GB &
    python -m benchmarks.top_screenshot docs/top.svg --requests 3 --after 20

Sends ``--requests`` streamed completions (two under the server's policy, one under a
sink + window policy, one after another's first turn so the prefix cache has a hit), and
takes the picture once every one of them has ``--after`` tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import httpx

PROMPTS = [
    ("Write a short story about a robot who learns to paint.", None),
    ("List the planets of the solar system.", {"window": 64, "sinks": 4}),
    ("Write a short story about a robot who learns to paint. Make it rhyme.", None),
]


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, kv, stop: asyncio.Event):
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 400, "stream": True}
    if kv:
        body["kv"] = kv
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if stop.is_set() or line == "data: [DONE]":
                return
            if line.startswith("data: "):
                json.loads(line[6:])


async def _shoot(url: str, path: str, requests: int, after: int, size: tuple[int, int]) -> None:
    from tui.top_app import TopApp
    from tui.top_client import fetch

    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [
            asyncio.create_task(_stream(client, url, prompt, kv, stop))
            for prompt, kv in PROMPTS[:requests]
        ]
        app = TopApp(url, None, 0.5, fetch(url, None))
        async with app.run_test(size=size) as pilot:
            while True:
                await pilot.pause(0.5)
                rows = app.status.get("running", [])
                if len(rows) >= requests and all(r["generated"] >= after for r in rows):
                    break
            app.save_screenshot(path)
        stop.set()
        for t in tasks:
            t.cancel()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the SVG to write")
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--requests", type=int, default=3, choices=range(1, len(PROMPTS) + 1))
    p.add_argument("--after", type=int, default=20, help="tokens each answer has first")
    p.add_argument("--size", default="100x34", help="terminal columns x rows")
    args = p.parse_args()
    cols, rows = (int(x) for x in args.size.split("x"))
    asyncio.run(_shoot(args.url, args.out, args.requests, args.after, (cols, rows)))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
