"""``mlxkv batch IN.jsonl -o OUT.jsonl``: many prompts in, one JSONL record per input line out.

The order of work: check the paths, parse the input, open (and repair) the output, write
the records for bad lines, and only then load the model -- so a mistake costs no model
load and nothing already written is ever lost.
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
    policy_from_args,
    settings_from_args,
    status,
)
from mlxkv.errors import UserError

HELP = "generate for every line of a JSONL file, batched and resumable"

DESCRIPTION = """\
Generate an answer for every line of IN.jsonl and append one JSON record per input line
to OUT.jsonl as each finishes (so records are in completion order, not input order).

Input lines: {"id": ..., "prompt": "..."} or {"id": ..., "messages": [{"role", "content"}]},
optionally with "max_tokens", "temperature", "top_p", "seed", "system" (these override the
flags for that line). Ids are strings or integers and must be unique: a repeated id is
reported and only its first line runs.

Output records: {"id", "line", "text", "finish_reason", "prompt_tokens",
"generation_tokens", "latency_s", "prompt_tps", "generation_tps"}; a line that cannot run
becomes {"id" (if known), "line", "error"} and the run goes on.

Resume: re-run the same command. Ids (and error lines) already in OUT.jsonl are skipped;
a torn last line (a kill mid-write) is cut off and redone. Nothing written is lost.

Batching: the full cache (the default) decodes --batch-size prompts together.
--kv-window / --kv-sinks / --kv-bits caches have no batched form: with those, the prompts
run one by one (same results, no batching speed-up), and the run says so.

Exit status: 0 all lines answered, 1 some lines became error records, 2 the run could not
start (bad paths, empty or non-JSON input, bad flags), 130 interrupted (re-run to resume)."""


def add_arguments(p) -> None:
    p.description = DESCRIPTION
    p.formatter_class = _raw_formatter()
    p.add_argument("input", metavar="IN.jsonl", help="input prompts, one JSON object per line")
    p.add_argument("-o", "--output", required=True, metavar="OUT.jsonl", help="results file")
    p.add_argument(
        "--batch-size",
        type=int,
        default=16,
        metavar="N",
        help="prompts decoded together (default 16)",
    )
    p.add_argument(
        "--raw", action="store_true", help="complete 'prompt' lines as is, no chat template"
    )
    p.add_argument("--system", default="", help="system prompt for lines that have none")
    p.add_argument(
        "--stats",
        action="store_true",
        help="print a JSON summary on stdout (throughput, tokens, errors)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_model_flags(p)
    add_cache_flags(p)
    add_generation_flags(p, max_tokens=256)


def _raw_formatter():
    import argparse

    return argparse.RawDescriptionHelpFormatter


# -- planning: which lines run, which become error records, which are already done ----------
def _plan(entries, log, warn):
    from mlxkv.engine.batch_input import BadLine, find_duplicates, id_key

    dups = find_duplicates(entries)
    for line, first in dups.items():
        ident = next(e.id for e in entries if e.line == line)
        warn(f"duplicate id {ident!r} on line {line} (first on line {first}): line {line} not run")
    jobs, bad, skipped = [], [], 0
    for e in entries:
        if e.line in dups:
            if e.line in log.done_lines:
                skipped += 1
            else:
                msg = f"duplicate id {e.id!r} (first on line {dups[e.line]}); not run"
                bad.append(BadLine(e.line, msg, e.id))
        elif (e.id is not None and id_key(e.id) in log.done_ids) or (
            e.id is None and e.line in log.done_lines
        ):
            skipped += 1
        elif isinstance(e, BadLine):
            bad.append(e)
        else:
            jobs.append(e)
    return jobs, bad, skipped


def _prompt_text(job, tokenizer, args) -> str:
    if job.prompt is not None and args.raw:
        if job.system:
            raise UserError("'system' needs the chat template; drop it or --raw")
        return job.prompt
    messages = job.messages or [{"role": "user", "content": job.prompt}]
    has_system = any(m["role"] == "system" for m in messages)
    if job.system is not None and has_system:
        raise UserError("both 'system' and a system message; give one")
    system = job.system if job.system is not None else args.system
    if system and not has_system:  # --system fills in for lines without their own
        messages = [{"role": "system", "content": system}, *messages]
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja errors from the model's own template
        raise UserError(f"the chat template rejected these messages: {e}") from None


def _settings(job, base):
    return replace(base, **job.overrides) if job.overrides else base


# -- progress on stderr ----------------------------------------------------------------------
class Progress:
    """A one-line bar redrawn in place on a terminal; occasional lines otherwise."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled and total > 0
        self.tty = sys.stderr.isatty()
        self.done = self.errors = self.tokens = 0
        self.t0 = time.perf_counter()
        self._last = 0.0

    def update(self, ok: bool, tokens: int) -> None:
        self.done += 1
        self.errors += not ok
        self.tokens += tokens
        now = time.perf_counter()
        final = self.done == self.total
        if not self.enabled or (now - self._last < (0.2 if self.tty else 10.0) and not final):
            return
        self._last = now
        width = 24
        fill = width * self.done // self.total
        rate = self.tokens / max(now - self.t0, 1e-9)
        text = (
            f"batch [{'#' * fill}{'-' * (width - fill)}] {self.done}/{self.total}"
            f"  {self.errors} errors  {rate:.1f} tok/s  {now - self.t0:.0f}s"
        )
        if self.tty:
            sys.stderr.write("\r" + text + ("\n" if final else ""))
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def clear(self) -> None:
        if self.enabled and self.tty and self.done < self.total:
            sys.stderr.write("\n")


# -- the command -----------------------------------------------------------------------------
def run(args) -> int:
    from mlxkv.engine.batch_input import read_input
    from mlxkv.engine.batch_output import ResultLog

    policy = policy_from_args(args)
    base = settings_from_args(args)
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {args.batch_size}")
    inp, out = Path(args.input), Path(args.output)
    if out.exists() and inp.exists() and os.path.samefile(inp, out):
        raise UserError("the output file is the input file; give another -o path")
    entries = read_input(inp)
    log = ResultLog(out)
    log.open()
    try:
        if log.torn_bytes:
            status(f"{out}: cut a torn last line ({log.torn_bytes} bytes); that result is redone")
        jobs, bad, skipped = _plan(entries, log, status)
        if skipped:
            status(f"resuming: {skipped} lines already in {out}")
        for b in bad:  # before the model loads: cheap, and nothing waits on them
            log.append(b.record())
        if not jobs:
            status(f"nothing left to run; {len(bad)} error records written to {out}")
            return _finish(args, policy, log, [], bad, skipped, 0.0, None)
        return _generate(args, policy, base, log, jobs, bad, skipped)
    finally:
        log.close()


def _generate(args, policy, base, log, jobs, bad, skipped) -> int:
    from mlxkv.engine.batch import BatchRunner, Request
    from mlxkv.engine.batch_input import BadLine
    from mlxkv.engine.loading import open_model

    loaded = open_model(
        args.model, args.dtype, policy, args.force, batch=args.batch_size, on_status=status
    )
    runner = BatchRunner(loaded, policy, args.batch_size, args.prefill_step)
    if runner.batched:
        status(f"{len(jobs)} prompts, batch size {args.batch_size}, cache: {policy.describe()}")
    else:
        status(f"{len(jobs)} prompts one by one: {runner.fallback_reason}")

    progress = Progress(len(jobs), not args.no_progress)
    by_line = {j.line: j for j in jobs}
    results, errors = [], list(bad)

    def requests():
        for job in jobs:
            try:
                text = _prompt_text(job, loaded.tokenizer, args)
            except UserError as e:
                err = BadLine(job.line, str(e), job.id)
                log.append(err.record())
                errors.append(err)
                progress.update(False, 0)
                continue
            yield Request(job.line, text, _settings(job, base))

    t0 = time.perf_counter()
    try:
        for r in runner.run(requests()):
            job = by_line[r.key]
            if r.error:
                err = BadLine(job.line, r.error, job.id)
                log.append(err.record())
                errors.append(err)
            else:
                log.append(_record(job, r))
                results.append(r)
            progress.update(r.error is None, r.generation_tokens)
    except KeyboardInterrupt:
        progress.clear()
        status(f"interrupted: {log.records} records are safe in {log.path}; re-run to resume")
        raise
    elapsed = time.perf_counter() - t0
    return _finish(args, policy, log, results, errors, skipped, elapsed, runner)


def _record(job, r) -> dict:
    return {
        "id": job.id,
        "line": job.line,
        "text": r.text,
        "finish_reason": r.finish_reason,
        "prompt_tokens": r.prompt_tokens,
        "generation_tokens": r.generation_tokens,
        "latency_s": round(r.latency_s, 4),
        "prompt_tps": round(r.prompt_tps, 2),
        "generation_tps": round(r.generation_tps, 2),
    }


def _finish(args, policy, log, results, errors, skipped, elapsed, runner) -> int:
    gen_tokens = sum(r.generation_tokens for r in results)
    prompt_tokens = sum(r.prompt_tokens for r in results)
    tps = gen_tokens / elapsed if elapsed > 0 else 0.0
    status(
        f"done: {len(results)} results, {len(errors)} errors, {skipped} skipped; "
        f"{gen_tokens} tokens generated in {elapsed:.1f}s ({tps:.1f} tok/s) -> {log.path}"
    )
    if args.stats:
        summary = {
            "results": len(results),
            "errors": len(errors),
            "skipped": skipped,
            "prompt_tokens": prompt_tokens,
            "generation_tokens": gen_tokens,
            "elapsed_s": round(elapsed, 3),
            "generation_tps": round(tps, 3),
            "batched": bool(runner and runner.batched),
            "batch_size": args.batch_size,
            "policy": policy.to_dict(),
            "output": str(log.path),
        }
        print(json.dumps(summary))
    return 1 if errors else 0
