"""``mlxkv pull``: make a model available locally; the last stdout line is its folder."""

from __future__ import annotations

from mlxkv.commands.common import status

HELP = "download or convert a model; prints its local folder as the last line"


def add_arguments(p) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="alias, repo id, .gguf (default: the registry's default model)",
    )


def run(args) -> int:
    from mlxkv.models.resolve import resolve

    resolved = resolve(args.model, on_status=status)
    status(f"{resolved.source}")
    print(resolved.path)
    return 0
