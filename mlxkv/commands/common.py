"""Flags shared by the commands that run a model, and turning them into engine objects."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from mlxkv.engine.lookup import DRAFT_TOKENS, MAX_DRAFT_TOKENS
from mlxkv.errors import UserError
from mlxkv.policy import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, KVPolicy


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        "-m",
        default=None,
        help="local folder, .gguf file, registry alias or Hugging Face repo id "
        "(default: the registry default, see 'mlxkv models')",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "native", "float32", "float16", "bfloat16"),
        help="weight dtype; auto = float32 (dequantized) on the CPU backend, on a GPU "
        "(Metal, CUDA) the checkpoint's dtype with quantized weights kept packed, like "
        "mlx-lm; native = that GPU rule on any backend; float32/float16/bfloat16 = that "
        "dtype (packed on a GPU, dequantized on the CPU)",
    )
    p.add_argument(
        "--force", action="store_true", help="load even if the memory check says it won't fit"
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        default=None,
        help="a Jinja chat template file to render conversations with instead of the "
        "model's own (a fixed or extended one, or one for a model without); a tool-call "
        "format it writes that mlx-lm knows lets the model call tools",
    )
    p.add_argument(
        "--chat-template-args",
        metavar="JSON",
        default=None,
        help="arguments every render of the chat template gets unless a request gives its "
        """own, e.g. '{"enable_thinking": false}' (Qwen3's switch)""",
    )


def chat_template_from_args(args):
    """``--chat-template`` read and parsed and ``--chat-template-args`` checked, before any
    weight loads (``mlxkv.models.chat_template.ChatTemplate``); None when neither is given."""
    path, given = args.chat_template, args.chat_template_args
    if path is None and given is None:
        return None
    from mlxkv.models.chat_template import ChatTemplate, parse_template_args, read_template_file

    chosen = read_template_file(path) if path is not None else ChatTemplate()
    return replace(chosen, args=parse_template_args(given) if given is not None else {})


def add_overflow_flag(p: argparse.ArgumentParser) -> None:
    from mlxkv.engine.session import OVERFLOW_CHOICES

    p.add_argument(
        "--on-overflow",
        choices=OVERFLOW_CHOICES,
        default="stop",
        help="at the model's context limit: stop, or slide into a sink window",
    )


def add_cache_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV cache policy")
    g.add_argument(
        "--kv-window",
        type=int,
        default=None,
        metavar="W",
        help="keep the last W tokens (plus the sinks: S + W kept)",
    )
    g.add_argument(
        "--kv-sinks",
        type=int,
        default=None,
        metavar="S",
        help="attention-sink tokens kept besides the window (default 4 with a window; 0 = none)",
    )
    g.add_argument(
        "--max-kv-size",
        type=int,
        default=None,
        metavar="M",
        help="keep M tokens in total, sinks included, as in mlx-lm (window = M - sinks)",
    )
    g.add_argument(
        "--kv-bits",
        type=int,
        default=None,
        metavar="B",
        help=f"quantize keys and values to B bits ({', '.join(map(str, SUPPORTED_BITS))}); "
        "keys per channel in groups of --kv-group-size tokens, the newest < G tokens kept in "
        "full precision (KIVI); values per token",
    )
    g.add_argument(
        "--kv-key-bits",
        type=int,
        default=None,
        metavar="B",
        help="bits for keys only (overrides --kv-bits for keys)",
    )
    g.add_argument(
        "--kv-value-bits",
        type=int,
        default=None,
        metavar="B",
        help="bits for values only (overrides --kv-bits for values), e.g. keys 4 / values 2",
    )
    g.add_argument(
        "--kv-group-size",
        type=int,
        default=None,
        metavar="G",
        help=f"quantization group size ({', '.join(map(str, SUPPORTED_GROUP_SIZES))}; default "
        "64): tokens per key group (KIVI), channels per value group",
    )
    g.add_argument(
        "--kv-value-group-size",
        type=int,
        default=None,
        metavar="G",
        help="group size for values (default: --kv-group-size)",
    )


def add_generation_flags(
    p: argparse.ArgumentParser,
    max_tokens: int | None = 512,  # None: no limit unless given (serve)
    prefill_step: int = 512,
    model_sampling: bool = False,
) -> None:
    """Sampling flags. With ``model_sampling`` the temperature, top-p and repetition
    penalty default to None: the caller takes them from the model (see
    mlxkv.engine.sampling) and only what the user typed overrides that."""
    g = p.add_argument_group("sampling")
    g.add_argument(
        "--max-tokens",
        type=int,
        default=max_tokens,
        help=f"tokens to generate at most; default {max_tokens}"
        if max_tokens is not None
        else "tokens an answer whose request sets no limit generates at most (default: no "
        "limit: until the model stops or its context is full, as OpenAI's and Ollama's "
        "servers do)",
    )
    if model_sampling:
        where = "default: the model's generation_config.json, else "
        g.add_argument(
            "--temp", type=float, default=None, help=f"temperature, 0 = greedy ({where}0.7)"
        )
        g.add_argument("--top-p", type=float, default=None, help=f"nucleus ({where}0.9)")
        g.add_argument(
            "--repetition-penalty",
            type=float,
            default=None,
            help=f"penalty on the last 20 tokens ({where}1.1)",
        )
    else:
        g.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy)")
        g.add_argument("--top-p", type=float, default=1.0)
        g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        metavar="N",
        help="neither EOS nor a stop string ends an answer before its Nth token (default 0)",
    )
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="EOS never ends an answer: it runs to --max-tokens (answers of a set length, to "
        "measure speed)",
    )
    g.add_argument(
        "--thinking-budget",
        type=int,
        default=None,
        metavar="N",
        help="a thinking model writes at most N tokens of reasoning, then its think block is "
        "closed for it (default: no limit)",
    )
    g.add_argument(
        "--draft-tokens",
        type=_draft_count,
        default=DRAFT_TOKENS,
        metavar="N",
        help="an answer checks up to N tokens a step that followed its last tokens earlier "
        "in the conversation (or, held to a JSON schema, that the schema forces), and keeps "
        "those the model agrees with (faster where it repeats; a greedy answer is the same "
        "with an unquantized KV cache, a sampled one is drawn from the same distribution; "
        f"not with --seed); 0: off (default {DRAFT_TOKENS})",
    )
    g.add_argument(
        "--prefill-step",
        type=int,
        default=prefill_step,
        help=f"prompt tokens per model call (prefill; default {prefill_step})",
    )


def _draft_count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_DRAFT_TOKENS:
        raise argparse.ArgumentTypeError(
            f"expected a whole number from 0 (off) to {MAX_DRAFT_TOKENS}, got {text!r}"
        )
    return n


SCHEMA_LIMIT = 1 << 20  # bytes of a --json-schema file


def add_schema_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json-schema",
        metavar="FILE",
        help="hold the answer to this JSON Schema (a JSON file): its text parses as JSON "
        "that matches it, unless --max-tokens cuts it (constrained decoding)",
    )


def grammar_from_args(args) -> tuple[dict | None, str | None]:
    """The --json-schema file's schema and its grammar (None, None: not given); a file that
    is missing, too large, not a JSON object or not a schema llguidance can use is one
    line naming it."""
    path = getattr(args, "json_schema", None)
    if path is None:
        return None, None
    held = "--ignore-eos" if args.ignore_eos else "--min-tokens" if args.min_tokens else None
    if held:
        raise UserError(
            f"{held} cannot go with --json-schema: the answer ends where its schema does"
        )
    from mlxkv.engine.grammar import json_grammar
    from mlxkv.files import parse_json, read_text

    text = read_text(path, SCHEMA_LIMIT, "--json-schema")
    schema = parse_json(text, f"--json-schema {path}", utf8=True)
    if not isinstance(schema, dict):
        raise UserError(f"--json-schema {path} must hold a JSON object (a JSON Schema)")
    try:
        return schema, json_grammar(schema)
    except UserError as e:
        raise UserError(f"--json-schema {path}: {e}") from None


def policy_from_args(args) -> KVPolicy:
    return KVPolicy.from_flags(
        window=args.kv_window,
        sinks=args.kv_sinks,
        bits=args.kv_bits,
        group_size=args.kv_group_size,
        max_kv_size=args.max_kv_size,
        key_bits=args.kv_key_bits,
        value_bits=args.kv_value_bits,
        value_group_size=args.kv_value_group_size,
    )


SEED_MAX = 2**64 - 1  # MLX seeds are unsigned 64-bit


def _number(flag: str, value, lo=None, hi=None, lo_open=False, hint: str = "") -> None:
    """Refuse nan/inf and values outside [lo, hi] (or (lo, hi]) with one line naming the flag."""
    if value is None:
        return
    bad = value != value or value in (float("inf"), float("-inf"))  # nan, inf
    bad = bad or (lo is not None and (value <= lo if lo_open else value < lo))
    bad = bad or (hi is not None and value > hi)
    if bad:
        if lo is not None and hi is not None:
            want = f"in {'(' if lo_open else '['}{lo}, {hi}]"
        elif lo is not None:
            want = f"{'above' if lo_open else 'at least'} {lo}"
        else:
            want = f"at most {hi}"
        raise UserError(f"{flag} must be {want}, got {value}" + (f"; {hint}" if hint else ""))


def check_generation_flags(args) -> None:
    """Every sampling flag checked at the edge: a one-line error instead of a deep failure."""
    _number("--max-tokens", args.max_tokens, lo=1)
    _number("--temp", args.temp, lo=0, hint="0 means greedy")
    _number("--top-p", args.top_p, lo=0, hi=1, lo_open=True)
    _number("--min-p", args.min_p, lo=0, hi=1)
    _number("--top-k", args.top_k, lo=0, hint="0 keeps every token")
    _number("--repetition-penalty", args.repetition_penalty, lo=0, lo_open=True, hint="1 = none")
    _number("--seed", args.seed, lo=0, hi=SEED_MAX)
    _number("--prefill-step", args.prefill_step, lo=1)
    _number("--thinking-budget", args.thinking_budget, lo=0, hint="0 closes it at once")
    _number("--min-tokens", args.min_tokens, lo=0)


def settings_from_args(args):
    from mlxkv.engine.session import GenerationSettings

    check_generation_flags(args)

    from mlxkv.engine.request import RESERVE_STEP

    return GenerationSettings(
        max_tokens=args.max_tokens or RESERVE_STEP,  # (None: serve's open-ended answers)
        temperature=0.0 if args.temp is None else args.temp,
        top_p=1.0 if args.top_p is None else args.top_p,
        min_p=args.min_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
        prefill_step=args.prefill_step,
        think_budget=args.thinking_budget,
        min_tokens=args.min_tokens,
        ignore_eos=args.ignore_eos,
    )


def given_sampling(args) -> set[str]:
    """The GenerationSettings sampling fields the user set on the command line."""
    flags = {"temperature": args.temp, "top_p": args.top_p}
    flags["repetition_penalty"] = args.repetition_penalty
    flags |= {"top_k": args.top_k or None, "min_p": args.min_p or None}  # 0 = not given
    return {name for name, value in flags.items() if value is not None}


_quiet = False


def model_id(name: str) -> str:
    """What answers name the loaded model ``name`` by: a local folder's own name, else the
    alias or repo id it was asked by."""
    from pathlib import Path

    return Path(name).name if ("/" in name and Path(name).exists()) else name


def status(message: str) -> None:
    """Progress for the user on stderr (stdout is the command's output)."""
    if not _quiet:
        print(f"mlxkv: {message}", file=sys.stderr, flush=True)


def add_shard_flag(p: argparse.ArgumentParser, choices=("auto", "tensor", "pipeline")) -> None:
    data = (
        "data = every rank a whole model, the prompts split between them; "
        if "data" in choices
        else ""
    )
    p.add_argument(
        "--shard",
        choices=choices,
        default=choices[0],
        help=f"under mlx.launch: how the ranks share the work (default {choices[0]}): {data}"
        "tensor = each layer's heads split over the ranks (mlx-lm's shard()); pipeline = the "
        "layers split over the ranks; auto = tensor where the model has shard() and its "
        "heads divide by the ranks, else pipeline. Ignored in a single process",
    )


def join_cluster(args):
    """The distributed group when run under mlx.launch (None otherwise), every rank checked
    to run the same command (``args``); only rank 0 then writes output and progress."""
    global _quiet
    from mlxkv.engine.distributed import check_same_command, join, quiet_followers

    cluster = join()
    if cluster is not None:
        plain = (str, int, float, bool, list, tuple, type(None))
        check_same_command(cluster, {k: v for k, v in vars(args).items() if isinstance(v, plain)})
    quiet_followers(cluster)
    _quiet = cluster is not None and not cluster.leader
    return cluster
