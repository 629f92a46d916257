"""What a batch run still has to do, given its input and what its output file already holds.

Pure: no files, no model. Every record carries a fingerprint of what produced it (the input
line and the run's model, cache policy and sampling settings); a record answers an input
line only while the fingerprints agree. The output is append-only, so a line that is run
again gets a second record: the last record for a line is its answer.

Usage (what ``mlxkv batch`` does, and what any other writer of a batch output must do)::

    ctx = run_context(model=..., policy=policy.to_dict(), settings=..., ...)
    entries = [ResumeEntry(e.line, e.id, line_fingerprint(payload, ctx), runnable)
               for e in parsed_input]
    plan = plan_resume(entries, records_read_back_from_the_output, retry_errors=False)
    # plan.foreign -> refuse; plan.run -> the lines to run, each record written with its
    # entry's fingerprint under "fp"; exit 1 if plan.errors_kept or a new record is an error.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

FINGERPRINT_FIELD = "fp"


def run_context(**what_produces_the_text) -> str:
    """The run-wide part of every fingerprint (model, dtype, policy, sampling flags, ...)
    as canonical JSON. Only things that change the generated text belong here."""
    return json.dumps(what_produces_the_text, sort_keys=True, ensure_ascii=False, default=str)


def line_fingerprint(payload: object, context: str) -> str:
    """Fingerprint of one input line under a run context.

    ``payload`` is the line's parsed JSON object (so key order and spacing do not matter)
    or, for a line that is not JSON, its raw bytes. Lone surrogates (a line refused for
    them) are hashed as they are, so the fingerprint exists for every line."""
    if isinstance(payload, bytes):
        body = b"raw:" + payload
    else:
        text = json.dumps(payload, sort_keys=True, ensure_ascii=False)
        body = b"json:" + text.encode("utf-8", "surrogatepass")
    h = hashlib.sha256(context.encode("utf-8", "surrogatepass") + b"\0" + body)
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class ResumeEntry:
    """One input line as resume sees it."""

    line: int  # 1-based line number in the input
    id: str | int | None  # None: a line without a usable id
    fingerprint: str
    runnable: bool = True  # False: an input error, known before any model runs


@dataclass(frozen=True)
class ResumeRecord:
    """One record already in the output file."""

    line: int
    id: str | int | None
    fingerprint: str | None  # None: written without one (treated as changed)
    error: bool


@dataclass
class ResumePlan:
    run: list[int] = field(default_factory=list)  # input lines to (re)run, in input order
    done: list[int] = field(default_factory=list)  # lines whose last record still answers them
    changed: list[int] = field(default_factory=list)  # in run: their record no longer matches
    retried: list[int] = field(default_factory=list)  # in run: error records asked to retry
    errors_kept: list[int] = field(default_factory=list)  # in done: answered by an error
    foreign: list[ResumeRecord] = field(default_factory=list)  # records for no input line


def _id_key(ident) -> tuple:
    return (type(ident).__name__, ident)


def match_records(
    entries: list[ResumeEntry], records: list[ResumeRecord]
) -> tuple[dict[int, ResumeRecord], list[ResumeRecord]]:
    """The last record of each input line, and the records that belong to no input line.

    A record belongs to the input line with its line number when that line has the same id
    (or both have none); otherwise to the first line with its id (the input was reordered).
    An error record without an id (a line that was not a usable object) that matches no
    line is no one's once another record matches: its line was fixed, moved or deleted.
    """
    by_line = {e.line: e for e in entries}
    first_of_id: dict[tuple, int] = {}
    for e in entries:
        if e.id is not None:
            first_of_id.setdefault(_id_key(e.id), e.line)
    last: dict[int, ResumeRecord] = {}
    foreign: list[ResumeRecord] = []
    for r in records:
        here = by_line.get(r.line)
        if here is not None and (
            (r.id is None and here.id is None)
            or (r.id is not None and here.id is not None and _id_key(r.id) == _id_key(here.id))
        ):
            last[r.line] = r
        elif r.id is not None and _id_key(r.id) in first_of_id:
            last[first_of_id[_id_key(r.id)]] = r
        else:
            foreign.append(r)
    if last:
        foreign = [r for r in foreign if not (r.error and r.id is None)]
    return last, foreign


def plan_resume(
    entries: list[ResumeEntry], records: list[ResumeRecord], retry_errors: bool = False
) -> ResumePlan:
    """Decide, per input line, whether its last record still answers it.

    - no record: run it;
    - a record with another fingerprint (prompt, model, policy or settings changed): run it
      again (``changed``);
    - an error record, ``retry_errors`` and a runnable line: run it again (``retried``);
      an input error is not retried (it would give the same record);
    - otherwise it is done (``errors_kept`` if that record is an error).
    Records matching no input line are returned in ``foreign``: the output belongs to
    another input, and the caller should refuse to append to it.
    """
    last, foreign = match_records(entries, records)
    plan = ResumePlan(foreign=foreign)
    for e in entries:
        r = last.get(e.line)
        if r is None:
            plan.run.append(e.line)
        elif r.fingerprint != e.fingerprint:
            plan.run.append(e.line)
            plan.changed.append(e.line)
        elif r.error and retry_errors and e.runnable:
            plan.run.append(e.line)
            plan.retried.append(e.line)
        else:
            plan.done.append(e.line)
            if r.error:
                plan.errors_kept.append(e.line)
    return plan
