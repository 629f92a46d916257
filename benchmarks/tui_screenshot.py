"""Save an SVG of the app streaming a real answer from the default model (for the README).

    python -m benchmarks.tui_screenshot docs/chat.svg --kv-window 64 --after 90

The picture is taken mid-answer, once ``--after`` tokens have streamed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

QUESTION = "Write a short story about a robot who learns to paint."


async def _shoot(path: str, window: int | None, after: int, size: tuple[int, int]) -> None:
    from mlxkv.engine.session import GenerationSettings
    from mlxkv.policy import KVPolicy
    from tui.app import ChatApp
    from tui.engine import ChatEngine, real_opener
    from tui.pilot import send, settle, wait_for, wait_idle

    policy = KVPolicy.from_flags(window=window)
    settings = GenerationSettings(max_tokens=after + 40, seed=0)  # chat's sampling, repeatable
    engine = ChatEngine(real_opener(), settings, policy=policy)
    app = ChatApp(engine)
    async with app.run_test(size=size) as pilot:
        await wait_idle(app, pilot, timeout=600)
        await send(app, pilot, QUESTION, wait=False, timeout=600)
        await wait_for(pilot, lambda: app.panel.stats.generation_tokens >= after, timeout=900)
        for widget in app.screen.walk_children():
            if hasattr(widget, "cursor_blink"):
                widget.cursor_blink = False
        await pilot.pause(0.3)
        app.save_screenshot(path)
        app.action_stop()
        await settle(pilot)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path")
    p.add_argument("--kv-window", type=int, default=64)
    p.add_argument("--after", type=int, default=90)
    p.add_argument("--size", default="140x42")
    args = p.parse_args(argv)
    w, h = map(int, args.size.split("x"))
    asyncio.run(_shoot(args.path, args.kv_window, args.after, (w, h)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
