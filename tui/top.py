"""``mlxkv top [URL]``: a live view of a running ``mlxkv serve`` (its requests, memory,
queue and prefix cache), polling ``GET /v1/status``. Registered with the CLI as an
``mlxkv.commands`` entry point (pyproject.toml); Textual is imported only when it runs."""

from __future__ import annotations

import os
import sys

HELP = "live view of a running mlxkv serve: requests, KV memory, queue, prefix cache"
DEFAULT_URL = "http://127.0.0.1:8080"


def add_arguments(p) -> None:
    p.add_argument(
        "url",
        nargs="?",
        default=DEFAULT_URL,
        metavar="URL",
        help=f"the server (default {DEFAULT_URL}; a trailing /v1 is fine)",
    )
    p.add_argument(
        "--interval",
        type=_interval,
        default=0.5,
        metavar="SECONDS",
        help="seconds between two polls of GET /v1/status (default 0.5)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("MLXKV_API_KEY"),
        metavar="KEY",
        help="the server's API key (default: $MLXKV_API_KEY)",
    )


def _interval(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0.05 <= value <= 3600:
        raise argparse.ArgumentTypeError("must be between 0.05 and 3600 seconds")
    return value


def run(args) -> int:
    from urllib.parse import urlsplit, urlunsplit

    from tui.top_client import Unreachable, base_url, fetch

    url = base_url(args.url)
    parts = urlsplit(url)
    if parts.username is not None or parts.password is not None:  # never echoed back
        bare = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        print(
            f"mlxkv top: error: the URL holds a user or password; give {bare} and the key "
            "with --api-key or MLXKV_API_KEY",
            file=sys.stderr,
        )
        return 2
    try:
        first = fetch(url, args.api_key)
    except Unreachable as e:
        print(f"mlxkv top: error: {e}", file=sys.stderr)
        return 1
    from tui.top_app import TopApp

    app = TopApp(url, args.api_key, args.interval, first)
    app.run()
    return app.return_code or 0
