"""``mlxkv generate``: one prompt in, streamed text (or one JSON object) out."""

from __future__ import annotations

import json
import sys
import time

from mlxkv.commands.common import (
    add_cache_flags,
    add_generation_flags,
    add_model_flags,
    add_overflow_flag,
    add_shard_flag,
    join_cluster,
    policy_from_args,
    settings_from_args,
    status,
)
from mlxkv.errors import UserError

HELP = "generate text for one prompt (streamed; --json for a result object)"


def add_arguments(p) -> None:
    p.add_argument("--prompt", "-p", required=True, help="the prompt text, or - to read stdin")
    p.add_argument("--system", default="", help="system prompt (chat template only)")
    p.add_argument("--raw", action="store_true", help="no chat template: complete the text as is")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    add_model_flags(p)
    add_overflow_flag(p)
    add_cache_flags(p)
    add_generation_flags(p, max_tokens=256)
    add_shard_flag(p)


def _read_prompt(arg: str) -> str:
    text = _read_stdin() if arg == "-" else arg
    if not text.strip():
        raise UserError("the prompt is empty; pass --prompt TEXT or pipe text to --prompt -")
    return text


def _read_stdin() -> str:
    if sys.stdin is None or sys.stdin.closed:
        raise UserError("--prompt - reads stdin, but stdin is closed; pipe the prompt in")
    try:
        data = sys.stdin.buffer.read()
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the prompt from stdin: {e}") from None
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


def run(args) -> int:
    from mlxkv.backend import blas
    from mlxkv.engine.chat import ChatSession
    from mlxkv.engine.events import Finished, Notice, PrefillProgress, TokenDelta
    from mlxkv.engine.loading import open_model
    from mlxkv.engine.session import Generator

    policy = policy_from_args(args)
    settings = settings_from_args(args)
    prompt = _read_prompt(args.prompt)
    cluster = join_cluster()
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
    )
    gen = Generator(loaded, policy, overflow=args.on_overflow)
    if args.raw:
        events = gen.run(prompt, settings)
    else:
        events = ChatSession(gen, settings, system=args.system).send(prompt)
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
    from mlxkv.engine.distributed import rank_kv_report

    per_rank = rank_kv_report(cluster, loaded, s)
    if args.json:
        out = {
            "text": final.text,
            "finish_reason": final.finish_reason,
            "prompt_tokens": s.prompt_tokens,
            "generation_tokens": s.generation_tokens,
            "prompt_tps": round(s.prompt_tps, 3),
            "generation_tps": round(s.generation_tps, 3),
            "peak_memory_bytes": s.peak_memory,
            "kv_tokens": s.kv_tokens,
            "kv_evicted": s.kv_evicted,
            "kv_bytes_actual": s.kv_bytes_actual,
            "kv_bytes_logical": s.kv_bytes_logical,
            "kv_bytes_predicted": s.kv_bytes_predicted,
            "weights_bytes": s.weights_bytes,
            "model": loaded.name,
            "dtype": loaded.dtype,
            "policy": policy.to_dict(),
            "blas": blas(),
            **per_rank,
        }
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        status(
            f"{s.prompt_tokens} prompt tokens at {s.prompt_tps:.1f} tok/s, "
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
