"""``mlxkv bench``: speed, memory, long-stream quality and roofline, side by side with
mlx-lm, in one run; writes benchmarks.md, bench-results.json and PNG plots to --out.

Import stays light (no MLX here): the CLI imports every command module to build its help.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from mlxkv.errors import UserError

HELP = "benchmark mlxkv against mlx-lm (speed, memory, quality, roofline); writes a report"

DESCRIPTION = """\
Measure, in one run on this machine and the default model (or --model):
  1. engine overhead: prefill and decode tok/s, mlxkv's engine vs mlx-lm stream_generate
  2. cache policies (window, sink+window, 8-bit, 4-bit, sink+4-bit) vs the closest mlx-lm
     cache: speed, KV bytes, peak memory, speed over a long stream
  3. long-stream quality: perplexity per policy below and past the model's context
  4. roofline: measured memory bandwidth vs bytes read per decoded token
  5. batch: mlxkv batch vs one by one vs mlx-lm batch_generate
  6. prediction: predicted vs actual KV bytes and peaks
and write OUT/benchmarks.md, OUT/bench-results.json and OUT/bench-*.png.

The full run takes about 20 minutes on a quiet 2-core x86 CPU (two full-cache streams up
to the 8192-token context take 10 core-minutes each there); --quick (under a minute)
runs every section on tiny sizes, as CI's smoke test does."""

SECTION_NAMES = ("engine", "speed", "streams", "roofline", "batch")


def add_arguments(p) -> None:
    import argparse

    p.description = DESCRIPTION
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument(
        "--text",
        required=True,
        metavar="FILE",
        help="UTF-8 text read as the long stream (prompts and perplexity)",
    )
    p.add_argument(
        "--out", default="bench-out", metavar="DIR", help="output folder (default: bench-out)"
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test (under a minute)")
    p.add_argument("--model", "-m", default=None, help="model (default: the registry default)")
    p.add_argument(
        "--only",
        default=None,
        metavar="SECTIONS",
        help=f"comma-separated subset of: {', '.join(SECTION_NAMES)} (default: all)",
    )
    p.add_argument(
        "--streams",
        default=None,
        metavar="CONFIGS",
        help="comma-separated long-stream configurations (default: full,4bit,sink-window,"
        "lm-rot; also window, 8bit, sink-4bit, lm-full, lm-rot0, lm-rot-decode, lm-q8, lm-q4)",
    )
    p.add_argument(
        "--kept",
        type=int,
        default=None,
        metavar="K",
        help="tokens every bounded cache keeps, sinks included (default 1024; quick 64)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        metavar="N",
        help="interleaved repeats of the engine and speed comparisons (default 3 and 1)",
    )
    p.add_argument(
        "--stream-tokens", type=int, default=None, help="length of the long streams (tokens)"
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="worker processes for the speed and stream jobs, each pinned to a core "
        "(default: one per core on a Linux CPU, else 1)",
    )


def _sections(only: str | None) -> tuple[str, ...]:
    if only is None:
        return SECTION_NAMES
    chosen = tuple(s.strip() for s in only.split(",") if s.strip())
    if not chosen:
        raise UserError(f"--only names no section; use some of {', '.join(SECTION_NAMES)}")
    bad = [s for s in chosen if s not in SECTION_NAMES]
    if bad:
        raise UserError(f"--only: unknown section {bad[0]!r}; use {', '.join(SECTION_NAMES)}")
    return chosen


def run(args) -> int:
    from dataclasses import replace

    from mlxkv.bench.configs import all_configs
    from mlxkv.bench.scale import FULL, QUICK
    from mlxkv.models.resolve import check_name

    scale = QUICK if args.quick else FULL
    for flag in ("repeats", "workers", "kept", "stream_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if args.repeats is not None:
        scale = replace(scale, engine_repeats=args.repeats, speed_repeats=args.repeats)
    if args.kept is not None:
        scale = replace(scale, kept=args.kept)
    if args.stream_tokens is not None:
        if args.stream_tokens < 2 * scale.chunk:
            raise UserError(f"--stream-tokens must be at least {2 * scale.chunk}")
        marks = tuple(c for c in scale.checkpoints if c < args.stream_tokens)
        scale = replace(
            scale, stream_tokens=args.stream_tokens, checkpoints=(*marks, args.stream_tokens)
        )
    if scale.kept <= scale.sinks + 1:
        raise UserError(f"--kept must be larger than {scale.sinks + 1}")
    args.sections = _sections(args.only)
    if args.streams:
        keys = tuple(s.strip() for s in args.streams.split(",") if s.strip())
        known = all_configs(scale.kept, scale.sinks)
        bad = [k for k in keys if k not in known]
        if bad:
            raise UserError(f"--streams: unknown configuration {bad[0]!r}; use {', '.join(known)}")
        scale = replace(scale, stream_configs=keys)
    args.command_line = (
        "mlxkv " + shlex.join(sys.argv[1:])
        if sys.argv[1:2] == ["bench"]
        else ("mlxkv bench " + shlex.join(a for a in _argv(args)))
    )
    _check_text(Path(args.text))
    check_name(args.model)  # a model that cannot resolve fails before --out is made
    out = Path(args.out)
    _check_out(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create the folder ({e.strerror})") from None

    from mlxkv.bench import run as bench_run

    res = bench_run.run(args, scale, batch_command=_batch_command)
    path = bench_run.write(res, out)
    bench_run.log(f"report written to {path} ({res['total_seconds'] / 60:.1f} min)")
    print(path)
    return 0


def _batch_command(argv: list[str]) -> int:
    """``mlxkv batch ARGV`` in this process, for the bench's batch section."""
    import argparse

    from mlxkv.commands import batch

    parser = argparse.ArgumentParser(prog="mlxkv batch")
    batch.add_arguments(parser)
    return batch.run(parser.parse_args(argv[1:]))


def _check_text(path: Path) -> None:
    """--text is read by worker processes much later: fail now, before --out is made."""
    from mlxkv.bench.corpus import read_text

    read_text(path)


def _check_out(out: Path) -> None:
    """The report goes into a new folder, or one holding an earlier report (replaced)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a folder for the report")
    if out.is_dir() and any(out.iterdir()) and not _holds_a_report(out):
        raise UserError(
            f"--out {out} holds files that are not a bench report; give a new or empty folder"
        )


def _holds_a_report(out: Path) -> bool:
    """Whether ``out``'s bench-results.json and benchmarks.md are what a run writes: only
    those are replaced, never a file of the user's that has one of their names."""
    from mlxkv.bench.report import TITLE
    from mlxkv.files import parse_json, read_text

    try:
        results = parse_json(read_text(out / "bench-results.json", 64 << 20), "results")
        md = out / "benchmarks.md"
        title = read_text(md, 64 << 20).split("\n", 1)[0] if md.exists() else TITLE
    except UserError:
        return False
    keys = ("machine", "model", "scale", "total_seconds")
    return isinstance(results, dict) and all(k in results for k in keys) and title == TITLE


def _argv(args):
    """The flags of a programmatic call, for the report's command line."""
    yield from ("--text", str(args.text), "--out", str(args.out))
    if args.quick:
        yield "--quick"
    for flag in ("model", "only", "streams", "kept", "repeats", "stream_tokens"):
        v = getattr(args, flag)
        if v:
            yield "--" + flag.replace("_", "-")
            yield str(v)
