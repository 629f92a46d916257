"""``mlxkv generate``: one prompt (or a conversation) in, streamed text (or one JSON object) out.

With ``--messages`` the answer is the conversation's next assistant turn; with
``--prompt-cache`` the caches and the token ids they hold persist in a file between calls,
so a call prefills only what the file does not already hold (see ``Session``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from mlxkv.commands.common import (
    add_cache_flags,
    add_generation_flags,
    add_model_flags,
    add_overflow_flag,
    add_schema_flag,
    add_shard_flag,
    chat_template_from_args,
    grammar_from_args,
    join_cluster,
    policy_from_args,
    settings_from_args,
    status,
)
from mlxkv.engine.conversation import conversation_problem, plain_messages
from mlxkv.engine.distributed import check_stdin_unused
from mlxkv.errors import UserError
from mlxkv.files import check_text, parse_json, read_text

HELP = "generate text for one prompt or conversation (streamed; --json for a result object)"


def add_arguments(p) -> None:
    p.add_argument("--prompt", "-p", default=None, help="the prompt text, or - to read stdin")
    p.add_argument(
        "--messages",
        default=None,
        metavar="CONV.json",
        help='a JSON list of chat messages ({"role": "system"|"user"|"assistant", '
        '"content": "..."}, a system message only first; OpenAI\'s developer role and text '
        "parts are read too); the answer is the next assistant turn. Give --prompt or "
        "--messages",
    )
    p.add_argument(
        "--prompt-cache",
        default=None,
        metavar="FILE.safetensors",
        help="keep the KV cache and its token ids in FILE between calls: "
        "loaded when it exists, saved (atomically) after the answer; a later call prefills "
        "only what FILE does not hold. A FILE made for another model, dtype or KV policy "
        "(or not a cache file) is refused with an error and left untouched",
    )
    p.add_argument("--system", default="", help="system prompt (chat template only)")
    p.add_argument(
        "--raw",
        action="store_true",
        help="no chat template: complete the text as is (the answer is what follows it, "
        "its first space included)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    add_model_flags(p)
    add_overflow_flag(p)
    add_cache_flags(p)
    add_generation_flags(p, max_tokens=256)
    add_schema_flag(p)
    add_shard_flag(p)


def _read_prompt(arg: str) -> str:
    text = check_text(_read_stdin() if arg == "-" else arg, "the prompt")
    if not text.strip():
        raise UserError("the prompt is empty; pass --prompt TEXT or pipe text to --prompt -")
    return text


MESSAGES_LIMIT = 64 << 20  # bytes of a --messages file
PROMPT_LIMIT = 256 << 20  # bytes of a prompt on stdin


def _read_messages(path: str) -> list[dict]:
    """The conversation in ``path``: a non-empty list of {"role", "content"} objects."""
    data = parse_json(
        read_text(path, MESSAGES_LIMIT, "--messages"), f"--messages {path}", utf8=True
    )
    data = plain_messages(data)  # OpenAI's developer role and text parts
    if problem := conversation_problem(data):
        raise UserError(f"--messages {path} {problem}")
    return [{"role": m["role"], "content": m["content"]} for m in data]


def _check_input(args) -> None:
    if (args.prompt is None) == (args.messages is None):
        raise UserError(
            "give the input as --prompt TEXT (--prompt - reads stdin) or --messages CONV.json "
            "(one of them)"
        )
    if args.messages is not None and args.raw:
        raise UserError("--raw completes plain text; it does not apply to --messages")
    if args.raw and args.system:
        raise UserError("--system goes into the chat template, which --raw skips; drop one")
    if args.raw and (args.chat_template or args.chat_template_args):
        flag = "--chat-template" if args.chat_template else "--chat-template-args"
        raise UserError(f"--raw skips the chat template that {flag} is for; drop one")


def _read_stdin() -> str:
    from mlxkv.files import read_stdin

    closed = "--prompt - reads stdin, but stdin is closed; pipe the prompt in"
    data = read_stdin(PROMPT_LIMIT, "the prompt", closed)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"the prompt on stdin is not UTF-8 text (byte {e.start}); convert it, "
            "e.g. iconv -f latin1 -t utf-8"
        ) from None


class PrefillBar:
    """Prompt reading progress on stderr: a bar redrawn in place in a terminal, and
    nothing when stderr is piped or the output is --json. Cleared before the answer."""

    WIDTH = 24

    def __init__(self, enabled: bool, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = enabled and self.stream.isatty()
        self.shown = False
        self.t0 = time.perf_counter()

    def update(self, done: int, total: int) -> None:
        if not self.enabled or done >= total - 1:  # one chunk: nothing worth a bar
            return
        fill = self.WIDTH * done // max(total, 1)
        rate = done / max(time.perf_counter() - self.t0, 1e-9)
        self.stream.write(
            f"\rmlxkv: reading the prompt [{'#' * fill}{'-' * (self.WIDTH - fill)}] "
            f"{done}/{total} tokens  {rate:.0f} tok/s\x1b[K"
        )
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False


def _check_cache_file(path: Path) -> None:
    """Refuse, before the model loads, a --prompt-cache that could not be read or written
    back (the file itself is checked again when it is read and when it is replaced)."""
    if path.suffix != ".safetensors":
        raise UserError(f"--prompt-cache {path} must end in .safetensors")
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise UserError(f"--prompt-cache {path} is not a regular file; name a .safetensors file")
    if not path.parent.is_dir():
        raise UserError(f"--prompt-cache {path}: the folder {path.parent} does not exist")
    if path.exists() and not (path.stat().st_mode & 0o200 and os.access(path, os.W_OK)):
        raise UserError(
            f"--prompt-cache {path} is read-only; make it writable (chmod u+w) or name another file"
        )


def run(args) -> int:
    from mlxkv.backend import blas, blas_threads
    from mlxkv.engine.chat import ChatSession
    from mlxkv.engine.events import Finished, Notice, PrefillProgress, TokenDelta
    from mlxkv.engine.loading import open_model
    from mlxkv.engine.session import Session

    _check_input(args)
    template = chat_template_from_args(args)
    check_stdin_unused(args.prompt == "-", "--prompt")
    policy = policy_from_args(args)
    settings = replace(settings_from_args(args), grammar=grammar_from_args(args)[1])
    messages = _read_messages(args.messages) if args.messages is not None else None
    prompt = _read_prompt(args.prompt) if messages is None else None
    system = args.system
    if messages and messages[0]["role"] == "system":
        if system:
            raise UserError("the system prompt is in --messages; drop --system")
        system, messages = messages[0]["content"], messages[1:]
    cache_file = Path(args.prompt_cache) if args.prompt_cache else None
    if cache_file is not None:
        _check_cache_file(cache_file)
    cluster = join_cluster(args)
    if cluster is not None and cache_file is not None:
        raise UserError("--prompt-cache works in one process; drop it under mlx.launch")
    if cluster is not None:
        from mlxkv.engine.distributed import shared_seed

        settings.seed = shared_seed(cluster, settings.seed)
    loaded = open_model(
        args.model,
        args.dtype,
        policy,
        args.force,
        on_status=status,
        cluster=cluster,
        shard=args.shard,
        chat_template=template,
    )
    gen = Session(loaded, policy, overflow=args.on_overflow, draft_tokens=args.draft_tokens)
    if cache_file is not None and cache_file.exists():
        gen.load_cache(cache_file)  # refuses (one line) a file made for something else
    if args.raw:
        events = gen.run(prompt, replace(settings, continues=True))
    else:
        chat = ChatSession(gen, settings, system=system)
        if messages is None:
            events = chat.send(prompt)
        else:
            chat.messages = messages
            events = chat.answer()
    final = None
    bar = PrefillBar(enabled=not args.json)
    for ev in events:
        if isinstance(ev, PrefillProgress):
            bar.update(ev.done, ev.total)
            continue
        bar.clear()
        if isinstance(ev, TokenDelta) and not args.json:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        elif isinstance(ev, Notice):
            status(ev.message)
        elif isinstance(ev, Finished):
            final = ev
    s = final.stats
    if cache_file is not None:
        gen.save_cache(cache_file)
    from mlxkv.engine.distributed import rank_kv_report

    per_rank = rank_kv_report(cluster, loaded, s)
    if args.json:
        out = {
            "text": final.text,
            "finish_reason": final.finish_reason,
            "prompt_tokens": s.prompt_tokens,
            "prompt_tokens_cached": s.prompt_tokens_cached,
            "generation_tokens": s.generation_tokens,
            "prompt_tps": round(s.prompt_tps, 3),
            "generation_tps": round(s.generation_tps, 3),
            "peak_memory_bytes": s.peak_memory,
            "kv_tokens": s.kv_tokens,
            "kv_evicted": s.kv_evicted,
            "kv_bytes_actual": s.kv_bytes_actual,
            "kv_bytes_logical": s.kv_bytes_logical,
            "kv_bytes_predicted": s.kv_bytes_predicted,
            "draft_tokens": s.draft_tokens,
            "draft_tokens_accepted": s.draft_tokens_accepted,
            "weights_bytes": s.weights_bytes,
            "model": loaded.name,
            "dtype": loaded.dtype,
            "policy": policy.to_dict(),
            "blas": blas(),
            "blas_threads": blas_threads(),
            **per_rank,
        }
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        status(
            f"{s.prompt_tokens} prompt tokens ({s.prompt_tokens_cached} from the cache) "
            f"at {s.prompt_tps:.1f} tok/s, "
            f"{s.generation_tokens} generated at {s.generation_tps:.1f} tok/s, "
            f"finish: {final.finish_reason}; KV {s.kv_tokens} tokens, "
            f"{s.kv_bytes_actual} bytes (predicted {s.kv_bytes_predicted})"
        )
        for r in per_rank.get("per_rank", []):
            status(
                f"rank {r['rank']}: KV {r['kv_bytes_actual']} bytes "
                f"(predicted {r['kv_bytes_predicted']}), weights {r['weights_bytes']} bytes"
            )
    return 0
