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

from mlxkv.commands import batch_openai as openai_batch
from mlxkv.commands.batch_openai import is_openai
from mlxkv.commands.common import (
    add_cache_flags,
    add_generation_flags,
    add_model_flags,
    add_schema_flag,
    add_shard_flag,
    chat_template_from_args,
    grammar_from_args,
    join_cluster,
    model_id,
    policy_from_args,
    settings_from_args,
    status,
)
from mlxkv.engine.distributed import check_stdin_unused
from mlxkv.errors import UserError

HELP = "generate for every line of a JSONL file, batched and resumable"

DESCRIPTION = """\
Generate an answer for every line of IN.jsonl and append one JSON record per input line
to OUT.jsonl as each finishes (so records are in completion order, not input order).

Input lines: {"id": ..., "prompt": "..."} or {"id": ..., "messages": [{"role", "content"}]},
optionally with "max_tokens", "temperature", "top_p", "seed", "stop", "system" (these
override the flags for that line) and "json_schema" (a JSON Schema the line's answer is
held to). Ids are strings or integers and must be unique: a repeated id is reported and
only its first line runs. A request line of OpenAI's Batch API ({"custom_id", "method":
"POST", "url": "/v1/chat/completions", "body": {"messages", ...}}) runs too: custom_id is
its id, and the body's max_tokens (or max_completion_tokens), temperature, top_p, seed,
stop and response_format are its fields; its "model" is ignored (the run's model answers).
Its record has the shape of OpenAI's batch output ({"id", "line", "custom_id", "response":
{"status_code", "request_id", "body": a chat.completion}, "error", "fp"}). A line for
"url": "/v1/embeddings" ({"input", "dimensions", "encoding_format"}) answers OpenAI's
embeddings list: each input's final hidden state at its last token (or their mean, where
the model's sentence-transformers files say so), made unit length. A line of this file's
own {"id", "input", "dimensions"?} does the same; its record is {"id", "line",
"embeddings": [one vector per input], "prompt_tokens", "fp"}.

IN.jsonl may be - to read stdin. A line that is not UTF-8 or not JSON becomes an error
record for that line; the other lines run.

Output records: {"id", "line", "text", "finish_reason", "prompt_tokens",
"generation_tokens", "latency_s", "prompt_tps", "generation_tps", "fp"}; a line that
cannot run becomes {"id" (if known), "line", "error", "fp"} and the run goes on. "fp" is a
fingerprint of what produced the record: the line itself, the model, dtype, cache policy,
sampling flags, --system, --raw and --json-schema.

Resume: re-run the same command. A line whose record is in OUT.jsonl with the same
fingerprint is skipped. A line whose prompt, messages or settings changed since (or a run
with another model, policy or sampling flags) is run again and gets a new record after the
old one: the last record for a line is its answer. --resume strict refuses such a run
instead. Error records are kept unless --retry-errors. OUT.jsonl is only ever appended to
(each record fsync'd); a run is refused, the file untouched, if OUT.jsonl holds anything but
records of this input. A torn last record (a kill mid-write) is cut and redone; a complete
last record without its newline is kept.

Batching: --batch-size prompts decode together under every cache policy (full, --kv-window,
--kv-sinks, --kv-bits and combinations); a finished prompt leaves the batch and a waiting one
joins. A prefix shared by waiting prompts (a system prompt, a document) is prefilled once.
Greedy results are token-identical to one-by-one generation. --stats adds the KV cache bytes
the batch allocated next to the memory model's prediction.

Exit status: 0 every line is answered by a result, 1 OUT.jsonl answers some lines of this
input with error records (written now or kept from before), 2 the run could not start
(bad paths, empty or non-JSON input, a foreign output file, bad flags), 130 interrupted by
Ctrl+C or SIGTERM (re-run to resume).

Under mlx.launch (see docs/distributed.md): --shard data (the default) gives every rank a
whole model and splits the prompts; rank 0 reads the input and alone writes OUT.jsonl.
--shard tensor/pipeline splits one model over the ranks, for a model one host cannot hold.
If a rank dies the job stops with a message from rank 0; re-run the same command to resume."""


def add_arguments(p) -> None:
    p.description = DESCRIPTION
    p.formatter_class = _raw_formatter()
    p.add_argument(
        "input", metavar="IN.jsonl", help="input prompts, one JSON object per line (- = stdin)"
    )
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
    p.add_argument(
        "--retry-errors", action="store_true", help="run lines answered by error records again"
    )
    p.add_argument(
        "--resume",
        choices=("rerun", "strict"),
        default="rerun",
        help="lines changed since their record was written: rerun them (default, a new "
        "record is appended) or strict: refuse the run",
    )
    add_model_flags(p)
    add_cache_flags(p)
    add_generation_flags(p, max_tokens=256)
    add_schema_flag(p)
    add_shard_flag(p, choices=("data", "auto", "tensor", "pipeline"))


def _raw_formatter():
    import argparse

    return argparse.RawDescriptionHelpFormatter


# -- planning: which lines run, which become error records, which are already done ----------
# Settings left out of the fingerprints: the prefill step does not change the text, and a
# batch cannot set the rest (they keep their defaults), so files written before those
# fields existed still resume.
NOT_IN_FINGERPRINT = (
    "prefill_step",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "continues",
    "grammar",
    "call_grammar",
    "think_budget",
    "open_ended",
    "repetition_context",
    "xtc_probability",
    "xtc_threshold",
    "min_tokens",
    "ignore_eos",
    "min_indent",
    "time_limit",
)


def _run_context(args, policy, base, schema: dict | None = None, template=None) -> str:
    """Everything run-wide that changes the text, for the records' fingerprints (the
    --json-schema and the chat template's file and arguments only when given: records
    written without them resume as they were)."""
    import hashlib
    from dataclasses import asdict

    from mlxkv.commands.batch_resume import run_context
    from mlxkv.models.registry import default_alias

    model = args.model or default_alias()
    if Path(model).expanduser().exists():  # a path: the same file however it is spelled
        model = str(Path(model).expanduser().resolve())
    settings = {k: v for k, v in asdict(base).items() if k not in NOT_IN_FINGERPRINT}
    return run_context(
        model=model,
        dtype=args.dtype,
        policy=policy.to_dict(),
        settings=settings,
        system=args.system,
        # a raw line's text now keeps its first space: records written before resume anew
        raw="continuation" if args.raw else False,
        **({"json_schema": schema} if schema is not None else {}),
        # as the schema: only when given, so records written before the flag still resume
        **({"think_budget": base.think_budget} if base.think_budget is not None else {}),
        **({"min_tokens": base.min_tokens} if base.min_tokens else {}),
        **({"ignore_eos": True} if base.ignore_eos else {}),
        **({"chat_template": hashlib.sha256(template.source.encode()).hexdigest()}
           if template is not None and template.source is not None else {}),
        **({"chat_template_args": template.args} if template and template.args else {}),
    )  # fmt: skip


def _plan(entries, log, context, args):
    """-> (jobs, bad, fingerprints, plan): runnable lines and input-error lines to write."""
    from mlxkv.commands.batch_input import BadLine, find_duplicates
    from mlxkv.commands.batch_resume import ResumeEntry, line_fingerprint, plan_resume

    dups = find_duplicates(entries)
    for line, first in dups.items():
        ident = next(e.id for e in entries if e.line == line)
        status(
            f"duplicate id {ident!r} on line {line} (first on line {first}): line {line} not run"
        )
    prepared = []
    for e in entries:
        if e.line in dups:
            e = BadLine(
                e.line,
                f"duplicate id {e.id!r} (first on line {dups[e.line]}); not run",
                e.id,
                e.source,
            )
        prepared.append(e)
    fps = {e.line: line_fingerprint(e.source, context) for e in prepared}
    resume = [ResumeEntry(e.line, e.id, fps[e.line], not isinstance(e, BadLine)) for e in prepared]
    plan = plan_resume(resume, log.existing, retry_errors=args.retry_errors)
    if plan.foreign:
        r = plan.foreign[0]
        what = f"id {r.id!r}" if r.id is not None else f"line {r.line}, without an id"
        raise UserError(
            f"output {log.path} holds {len(plan.foreign)} records that match no line of "
            f"{_input_name(args)} (first: {what}); it belongs to another "
            "input, so it is left untouched (give another -o file)"
        )
    if plan.changed and args.resume == "strict":
        lines = ", ".join(map(str, plan.changed[:5])) + (" ..." if len(plan.changed) > 5 else "")
        raise UserError(
            f"{len(plan.changed)} lines changed since their records in {log.path} were "
            f"written (input lines {lines}: prompt, model, policy or sampling settings); "
            "give another -o file, or drop --resume strict to run them again"
        )
    to_run = set(plan.run)
    jobs = [e for e in prepared if e.line in to_run and not isinstance(e, BadLine)]
    bad = [e for e in prepared if e.line in to_run and isinstance(e, BadLine)]
    return jobs, bad, fps, plan


def _input_name(args) -> str:
    return "stdin" if args.input == "-" else args.input


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


def _most_characters(loaded, policy) -> int | None:
    """Characters no prompt can exceed and still fit the context (None: no bound, with a
    window). Longer prompts are refused before the template or the tokenizer reads them."""
    from mlxkv.engine.request import most_prompt_characters

    if policy.window is not None:
        return None
    return most_prompt_characters(loaded.tokenizer, loaded.context_length)


def _characters(job) -> int:
    """The characters of a line's prompt or messages: its rendered prompt has them all."""
    if job.prompt is not None:
        return len(job.prompt)
    return sum(len(m["content"]) for m in job.messages)


def _check_length(characters: int, most: int | None, loaded) -> None:
    from mlxkv.engine.request import check_prompt_characters

    fix = "shorten it or use a window (--kv-window)"
    check_prompt_characters(characters, most, loaded.context_length, fix)


def _settings(job, base):
    return replace(base, **job.overrides) if job.overrides else base


# -- progress on stderr ----------------------------------------------------------------------
class Progress:
    """A one-line bar redrawn in place on a terminal; occasional lines otherwise."""

    def __init__(self, total: int, enabled: bool, errors: int = 0):
        self.total, self.enabled = total, enabled and total > 0
        self.tty = sys.stderr.isatty()
        self.done = self.tokens = 0
        self.errors = errors  # error records this run wrote before the first prompt ran
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


def _interrupt_on_sigterm() -> None:
    """SIGTERM stops the run as Ctrl+C does: the line saying which records are safe, exit
    130 (it ended the process silently, 143)."""
    import signal
    import threading

    def interrupt(*_):
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)


# -- the command -----------------------------------------------------------------------------
def run(args) -> int:
    from mlxkv.commands.batch_input import read_input
    from mlxkv.commands.batch_output import ResultLog

    policy = policy_from_args(args)
    schema, grammar = grammar_from_args(args)
    base = replace(settings_from_args(args), grammar=grammar)
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {args.batch_size}")
    check_stdin_unused(args.input == "-", "the input")
    template = chat_template_from_args(args)  # a bad file fails before any file is written
    cluster = join_cluster(args)
    if cluster is not None and not cluster.leader:
        return _follow(args, policy, cluster, template)  # never touches the input or output
    if cluster is None:
        _interrupt_on_sigterm()  # timeout, systemd and schedulers stop a run with SIGTERM
    if args.output == "-":
        raise UserError(
            "-o - would be a file named '-': records go to a file, which a rerun resumes; "
            "name one (e.g. -o out.jsonl)"
        )
    out = Path(args.output)
    if args.input != "-" and out.exists() and Path(args.input).exists():
        if os.path.samefile(args.input, out):
            raise UserError("the output file is the input file; give another -o path")
    entries = read_input(args.input)
    context = _run_context(args, policy, base, schema, template)
    log = ResultLog(out)
    log.open()
    try:
        jobs, bad, fps, plan = _plan(entries, log, context, args)
        if log.torn_bytes:
            status(f"{out}: cut a torn last line ({log.torn_bytes} bytes); that result is redone")
        if plan.done:
            status(f"resuming: {len(plan.done)} lines already in {out}")
        if plan.changed:
            status(f"{len(plan.changed)} lines changed since their records; running them again")
        if plan.retried:
            status(f"retrying {len(plan.retried)} lines answered by error records")
        for b in bad:  # before the model loads: cheap, and nothing waits on them
            log.append(_error_record(b, b.error, fps[b.line]))
        if cluster is not None:
            from mlxkv.engine.distributed import send_obj

            for r in range(1, cluster.size):  # the followers load a model only if there is work
                send_obj(cluster, bool(jobs), r)
        if not jobs:
            status(f"nothing left to run; {len(bad)} error records written to {out}")
            return _finish(args, policy, log, [], bad, plan, 0.0, None)
        return _generate(args, policy, base, log, jobs, bad, fps, plan, cluster, template)
    except KeyboardInterrupt:
        status(f"interrupted: {log.records} records are safe in {log.path}; re-run to resume")
        raise
    finally:
        log.close()


def _open(args, policy, cluster, template):
    """The model and runner on this rank (split over the ranks unless --shard data)."""
    from mlxkv.engine.batch import BatchRunner
    from mlxkv.engine.loading import open_model

    sharded = cluster is not None and args.shard != "data"
    if sharded:
        import mlx.core as mx

        from mlxkv.engine.distributed import shared_seed

        mx.random.seed(shared_seed(cluster, None))  # unseeded sampling in lockstep
    loaded = open_model(
        args.model,
        args.dtype,
        policy,
        args.force,  # every rank checks its own host's memory
        batch=args.batch_size,
        on_status=status,
        cluster=cluster if sharded else None,
        shard=args.shard,
        chat_template=template,
    )
    runner = BatchRunner(
        loaded,
        policy,
        args.batch_size,
        args.prefill_step,
        check_kv=args.stats,
        draft_tokens=args.draft_tokens,
    )
    return loaded, runner


def _follow(args, policy, cluster, template) -> int:
    """A follower rank: wait for rank 0's go, load, then serve its shares."""
    from mlxkv.engine.batch_ranks import follow_data, follow_lockstep
    from mlxkv.engine.distributed import recv_obj

    if not recv_obj(cluster, 0):
        return 0
    _, runner = _open(args, policy, cluster, template)
    if args.shard == "data":
        follow_data(cluster, runner)
    else:
        follow_lockstep(cluster, runner)
    return 0


def _generate(args, policy, base, log, jobs, bad, fps, plan, cluster=None, template=None) -> int:
    from mlxkv.commands.batch_input import BadLine
    from mlxkv.engine.batch import Request, Result
    from mlxkv.engine.request import GenerationSettings
    from mlxkv.models.pooling import trained_pooling
    from mlxkv.server.embeddings import finished

    loaded, runner = _open(args, policy, cluster, template)
    model_name = model_id(loaded.name)  # what OpenAI-shaped records name the model by
    asked = sorted(
        {str(m) for j in jobs if is_openai(j.source) and (m := j.source["body"].get("model"))}
    )
    if asked and asked != [model_name]:  # said once: the file was written for another model
        status(f"OpenAI lines name {', '.join(map(repr, asked[:3]))}; {model_name} answers them")
    work = runner
    if cluster is not None:
        from mlxkv.engine.batch_ranks import DataParallel, Lockstep
        from mlxkv.engine.distributed import on_terminate

        def stopped() -> str:
            return (
                "mlxkv batch: error: stopped: another rank exited (its error, or mlx.launch's "
                f"line about it, is above); {log.records} records are safe in {log.path}; run "
                "the same command again to resume"
            )

        on_terminate(stopped)
        if args.shard == "data":
            work = DataParallel(cluster, runner, args.batch_size)
            status(f"data parallel over {cluster.size} ranks, {args.batch_size} prompts each")
        else:
            work = Lockstep(cluster, runner)
            status(f"one model split over {cluster.size} ranks ({loaded.shard})")
    if runner.batched:
        status(f"{len(jobs)} prompts, batch size {args.batch_size}, cache: {policy.describe()}")
    else:
        status(f"{len(jobs)} prompts one by one: {runner.fallback_reason}")

    progress = Progress(len(jobs), not args.no_progress, errors=len(bad))
    by_line = {j.line: j for j in jobs}
    results, errors = [], list(bad)

    def write_error(job, message):
        log.append(_error_record(job, message, fps[job.line]))
        errors.append(BadLine(job.line, message, job.id))

    most = _most_characters(loaded, policy)

    embedding = GenerationSettings(max_tokens=1, prefill_step=base.prefill_step)
    pooling = trained_pooling(Path(loaded.path))[0] or "last"  # as mlxkv serve's default

    def requests():
        for job in jobs:
            if job.embed is not None:
                if (why := _embedding_problem(job, cluster, loaded, most)) is not None:
                    write_error(job, why)
                    progress.update(False, 0)
                    continue
                for i, given in enumerate(job.embed.inputs):
                    yield Request((job.line, i), given, embedding, embed=pooling)
                continue
            try:
                _check_length(_characters(job), most, loaded)  # before the template copies it
                text = _prompt_text(job, loaded.tokenizer, args)
                _check_length(len(text), most, loaded)
            except UserError as e:
                write_error(job, str(e))
                progress.update(False, 0)
                continue
            raw = args.raw and job.prompt is not None
            yield Request(job.line, text, replace(_settings(job, base), continues=raw))

    parts: dict[int, dict | None] = {}  # an embeddings line's results so far (None: failed)

    def embedded(r) -> None:
        """One input of an embeddings line done: the line's record once all are."""
        line, i = r.key
        job, got = by_line[line], parts.setdefault(line, {})
        if got is None:  # the line failed on an earlier input
            return
        if r.error:
            parts[line] = None
            write_error(job, f"input {i}: {r.error}")
            progress.update(False, 0)
            return
        got[i] = r
        if len(got) < len(job.embed.inputs):
            return
        done = [got[k] for k in range(len(got))]
        tokens = sum(x.prompt_tokens for x in done)
        vectors = [x.vector for x in done]
        fp = fps[line]
        if is_openai(job.source):
            record = openai_batch.embeddings_record
            log.append(record(job.id, line, fp, model_name, vectors, tokens, job.embed))
        else:
            shaped = [finished(v, job.embed).tolist() for v in vectors]
            own = {"id": job.id, "line": line, "embeddings": shaped, "prompt_tokens": tokens}
            log.append({**own, "fp": fp})
        results.append(Result(line, prompt_tokens=tokens))
        del parts[line]
        progress.update(True, 0)

    t0 = time.perf_counter()
    try:
        for r in work.run(requests()):
            if isinstance(r.key, tuple):
                embedded(r)
                continue
            job = by_line[r.key]
            if r.error:
                write_error(job, r.error)
            else:
                log.append(_result_record(job, r, fps[job.line], model_name))
                results.append(r)
            progress.update(r.error is None, r.generation_tokens)
    except KeyboardInterrupt:
        progress.clear()
        raise
    except RuntimeError as e:
        if cluster is None:
            raise
        from mlxkv.engine.distributed import lost_peer_message

        progress.clear()
        print(
            f"mlxkv batch: error: {lost_peer_message(e)}; {log.records} records are safe in "
            f"{log.path}; run the same command again to resume",
            file=sys.stderr,
        )
        return 1
    elapsed = time.perf_counter() - t0
    ranks = {}
    if cluster is not None:
        ranks = {
            "ranks": cluster.size,
            "shard": "data" if args.shard == "data" else loaded.shard,
            "weights_bytes_per_rank": loaded.weights_bytes,
        }
        if args.shard == "data":
            ranks["results_by_rank"] = work.done_by_rank
    return _finish(args, policy, log, results, errors, plan, elapsed, runner, ranks)


def _embedding_problem(job, cluster, loaded, most) -> str | None:
    """Why an embeddings line cannot run (None: it can): each input within the context
    and the vocabulary, on one machine."""
    if cluster is not None:
        return "embeddings run in a batch on one machine, not under mlx.launch; run it alone"
    vocab = loaded.config.get("vocab_size")
    for i, given in enumerate(job.embed.inputs):
        if isinstance(given, str):
            try:
                _check_length(len(given), most, loaded)
            except UserError as e:
                return f"input {i}: {e}"
        elif isinstance(vocab, int) and (far := max(given)) >= vocab:
            return f"input {i} holds token id {far}, outside the vocabulary [0, {vocab})"
    return None


def _error_record(entry, message: str, fp: str) -> dict:
    """The record of a line that could not run, in the shape of its input line's format."""
    from mlxkv.commands.batch_input import BadLine

    if is_openai(entry.source):
        return openai_batch.error_record(entry.id, entry.line, fp, message)
    return {**BadLine(entry.line, message, entry.id).record(), "fp": fp}


def _result_record(job, r, fp: str, model: str) -> dict:
    if is_openai(job.source):
        return openai_batch.result_record(job.id, job.line, fp, model, r)
    return {**_record(job, r), "fp": fp}


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


def _finish(args, policy, log, results, errors, plan, elapsed, runner, ranks=None) -> int:
    gen_tokens = sum(r.generation_tokens for r in results)
    prompt_tokens = sum(r.prompt_tokens for r in results)
    tps = gen_tokens / elapsed if elapsed > 0 else 0.0
    skipped = len(plan.done)
    status(
        f"done: {len(results)} results, {len(errors)} errors, {skipped} skipped; "
        f"{gen_tokens} tokens generated in {elapsed:.1f}s ({tps:.1f} tok/s) -> {log.path}"
    )
    if plan.errors_kept:
        status(
            f"{len(plan.errors_kept)} lines are answered by error records from before; fix "
            "those input lines, or --retry-errors to run lines that failed while running again"
        )
    if args.stats:
        summary = {
            "results": len(results),
            "errors": len(errors),
            "errors_kept": len(plan.errors_kept),
            "skipped": skipped,
            "prompt_tokens": prompt_tokens,
            "generation_tokens": gen_tokens,
            "elapsed_s": round(elapsed, 3),
            "generation_tps": round(tps, 3),
            "batched": bool(runner and runner.batched),
            "batch_size": args.batch_size,
            "policy": policy.to_dict(),
            "output": str(log.path),
            **(runner.kv_summary() if runner else {}),
        }
        summary.update(ranks or {})
        print(json.dumps(summary))
    return 1 if errors or plan.errors_kept else 0
