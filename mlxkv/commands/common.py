"""Flags shared by the commands that run a model, and turning them into engine objects."""

from __future__ import annotations

import argparse
import sys

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
        help="weight dtype; auto = float32 on the CPU backend, the checkpoint's on Metal; "
        "native = as stored (quantized stays quantized, like mlx-lm)",
    )
    p.add_argument(
        "--force", action="store_true", help="load even if the memory check says it won't fit"
    )


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
        help=f"quantize keys/values to B bits ({', '.join(map(str, SUPPORTED_BITS))})",
    )
    g.add_argument(
        "--kv-group-size",
        type=int,
        default=None,
        metavar="G",
        help=f"quantization group size ({', '.join(map(str, SUPPORTED_GROUP_SIZES))}; default 64)",
    )


def add_generation_flags(p: argparse.ArgumentParser, max_tokens: int = 512) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate at most")
    g.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument(
        "--prefill-step",
        type=int,
        default=512,
        help="prompt tokens per model call (prefill)",
    )


def policy_from_args(args) -> KVPolicy:
    return KVPolicy.from_flags(
        window=args.kv_window,
        sinks=args.kv_sinks,
        bits=args.kv_bits,
        group_size=args.kv_group_size,
        max_kv_size=args.max_kv_size,
    )


def settings_from_args(args):
    from mlxkv.engine.session import GenerationSettings

    return GenerationSettings(
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        min_p=args.min_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
        prefill_step=args.prefill_step,
    )


def status(message: str) -> None:
    """Progress for the user on stderr (stdout is the command's output)."""
    print(f"mlxkv: {message}", file=sys.stderr, flush=True)
