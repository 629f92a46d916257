"""``mlxkv chat [MODEL]``: the Textual chat UI. Kept light: Textual and MLX are imported
only when the command runs, so ``mlxkv --help`` stays fast. Registered with the CLI as
an ``mlxkv.commands`` entry point (pyproject.toml)."""

from __future__ import annotations

import os

from mlxkv.commands.common import (
    add_cache_flags,
    add_generation_flags,
    add_model_flags,
    add_overflow_flag,
    chat_template_from_args,
    given_sampling,
    policy_from_args,
    settings_from_args,
)
from mlxkv.errors import UserError

HELP = "chat in the terminal, with a live KV memory panel (actual vs predicted)"
# Prompt tokens per model call: small, so Esc / Ctrl+C stop a long prefill within a step.
PREFILL_STEP = 64


def add_arguments(p) -> None:
    p.add_argument(
        "model_name", nargs="?", default=None, metavar="MODEL", help="model (same as --model)"
    )
    p.add_argument("--system", default="", help="system prompt")
    p.add_argument(
        "--resume",
        action="store_true",
        help="reopen the last conversation (its model, KV policy and messages); "
        "conversations are kept in MLXKV_HOME/chats (default ~/.cache/mlxkv/chats)",
    )
    p.add_argument(
        "--metrics",
        default=os.environ.get("MLXKV_TUI_METRICS"),
        metavar="PATH",
        help="write UI timings (load, first paint, key latency, tok/s) as JSON to PATH "
        "(a new file, or one an earlier --metrics run wrote; any other file is refused)",
    )
    add_model_flags(p)
    add_overflow_flag(p)
    add_cache_flags(p)
    add_generation_flags(p, max_tokens=512, prefill_step=PREFILL_STEP, model_sampling=True)


def run(args) -> int:
    import sys

    app = build_app(args)
    app.run()
    code = app.return_code or 0
    # The conversation and the metrics are on disk and the terminal is restored. End the
    # process here: the interpreter's own teardown runs beside MLX's native threads (a
    # model load that cannot be stopped, the stream threads), and that can abort the
    # process (SIGABRT) after a clean quit.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def build_app(args):
    """The chat app for parsed ``mlxkv chat`` arguments (not started)."""
    from mlxkv.models.resolve import check_name
    from tui.app import ChatApp
    from tui.conversations import ConversationStore, policy_from_dict
    from tui.engine import ChatEngine, real_opener
    from tui.metrics import check_metrics_path

    if args.model_name and args.model and args.model_name != args.model:
        raise UserError(f"two models given: {args.model_name!r} and --model {args.model!r}")
    model = args.model_name or args.model
    policy = policy_from_args(args)  # bad flags fail here, before the screen opens
    metrics_path = check_metrics_path(args.metrics)
    settings = settings_from_args(args)
    store, resume = ConversationStore(), None
    if args.resume:
        last = store.last()
        if last is None:
            why = f" ({len(store.skipped)} unreadable: {store.skipped[0]})" if store.skipped else ""
            raise UserError(f"no saved conversation in {store.folder} to resume{why}")
        resume = store.resume(last)
        model = model or resume.get("model_arg") or resume.get("model")
        if resume.get("policy"):
            policy = policy_from_dict(resume["policy"])
    check_name(model)  # a name that cannot resolve fails here, not on the screen
    opener = real_opener(
        dtype=args.dtype,
        force=args.force,
        overflow=args.on_overflow,
        draft_tokens=args.draft_tokens,
        chat_template=chat_template_from_args(args),  # a bad file fails before the screen
    )
    engine = ChatEngine(
        opener, settings, policy=policy, system=args.system, given=given_sampling(args)
    )
    return ChatApp(engine, model=model, metrics_path=metrics_path, store=store, resume=resume)
