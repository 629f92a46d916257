"""The prefix cache: caches of finished requests, kept so later requests skip their prefix.

Agents and chat clients send the whole conversation every turn. When a request ends, the
scheduler keeps its caches (every token it fed: the prompt and the answer) with the copy
taken at its turn boundary (the prompt without its last token), under its policy. A new
request under the same policy takes the entry whose tokens share the longest usable prefix
with its prompt (:func:`mlxkv.engine.reuse.keep_prefix`: an exact trim, or the turn-boundary
copy for a window that has evicted), on a copy of the entry's caches (MLX arrays are shared
until written, so several requests can start from one entry), and prefills only the rest.

Two tiers, both bounded:

* memory: up to ``limit`` bytes (the caches' ``nbytes`` plus their copies'): turn-boundary
  copies go first, then whole entries, least recently used first. An evicted entry goes to
  the disk tier, if there is one.
* disk (:class:`DiskTier`): safetensors files in one folder, up to ``disk_limit`` bytes,
  least recently used file first out. Each file is checked before MLX reads it (model by
  content, policy, dtype, token ids, every layer's shapes: ``mlxkv.caches.persist``) and
  its data against its digest once read; a
  corrupted or foreign file is skipped with a log line and never loaded, and never deleted
  (only files this cache wrote are). A restarted server finds its files again, so an
  agent's next turn is answered from disk without prefilling the conversation again.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mlxkv.engine.request import common_prefix
from mlxkv.engine.reuse import Checkpoint, keep_prefix, load_held, save_held
from mlxkv.errors import first_line
from mlxkv.policy import KVPolicy

FILE_PREFIX = "prefix-"  # names of the files this cache writes (and so may delete)
OWN_FILE = re.compile(r"prefix-[0-9a-f]{32}\.safetensors")  # FILE_PREFIX, 32 hex digits
# and files.atomic_file's temporary name for one (tempfile's 8 random characters)
OWN_TEMPORARY = re.compile(r"\.prefix-[0-9a-f]{32}\.safetensors\.[a-z0-9_]{8}\.tmp")
TRIES = 3  # candidates tried per lookup (a candidate's bound can overstate what it reuses)
# A shorter shared prefix is prefilled, not taken: copying an entry (or loading a file) for
# a chat template's first few tokens saves nothing, and would count as a hit.
MIN_REUSE = 16
EARLIER_TURNS = 3  # entries a conversation keeps of its turns before the newest (see put)


_USES = itertools.count()


@dataclass(eq=False)  # compared by identity: fields hold MLX arrays
class Entry:
    policy: KVPolicy
    tokens: list[int]
    caches: list
    checkpoint: Checkpoint | None
    nbytes: int = 0
    # When it was last used, as a count: the ranks of a split server evict the same entry
    # (clock readings on two hosts may tie where the order does not).
    used: int = field(default_factory=lambda: next(_USES))

    def bound(self, ids: list[int]) -> int:
        """At most how many tokens of ``ids`` this entry can give."""
        n = common_prefix(self.tokens, ids[:-1])
        cp = self.checkpoint
        if cp is not None and ids[: len(cp.tokens)] == cp.tokens:
            n = max(n, len(cp.tokens))
        return n


@dataclass
class DiskFile:
    path: Path
    policy: dict
    tokens: list[int]
    size: int
    used: float


ABANDONED_AFTER = 60.0  # seconds: a write in progress touches its file far more often


def _abandoned_write(path: Path) -> bool:
    """The temporary file of a write this cache began (OWN_TEMPORARY) that nobody has
    touched for a while: its server was killed mid-write, and the file would hold disk
    space no limit counts."""
    if not OWN_TEMPORARY.fullmatch(path.name):
        return False
    try:
        return time.time() - path.stat().st_mtime > ABANDONED_AFTER
    except OSError:
        return False


class DiskTier:
    """Entries as safetensors files in ``folder`` (see the module docstring)."""

    def __init__(self, folder: Path, limit: int, identity: dict, log: Callable[[str], None]):
        self.folder = Path(folder)
        self.limit = limit
        self.identity = identity  # model_id and dtype every file must carry
        self.log = log
        self.files: dict[Path, DiskFile] = {}
        self.hits = 0
        self.folder.mkdir(parents=True, exist_ok=True)
        self.writable = os.access(self.folder, os.W_OK)
        if not self.writable:  # a shared, read-only cache still answers from its files
            log(f"prefix cache: {self.folder} is read-only: its files are read, none is written")
        self._scan()

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def _scan(self) -> None:
        from mlxkv.caches.persist import read_metadata

        for path in sorted(self.folder.iterdir()):
            if _abandoned_write(path):
                self._remove(path, "an unfinished write of a stopped server")
                continue
            if path.suffix != ".safetensors":
                continue
            try:
                meta = read_metadata(path)
                self._check(meta)
            except Exception as e:  # any reason at all: the file is not ours to load
                self.log(f"prefix cache: skipped {path.name}: {first_line(e)}")
                continue
            st = path.stat()
            self.files[path] = DiskFile(
                path, meta["policy"], meta["tokens"], st.st_size, st.st_mtime
            )

    def _check(self, meta: dict) -> None:
        for key, want in self.identity.items():
            if meta.get(key) != want:
                raise ValueError(f"made for another {key.replace('_id', '')}")
        tokens = meta.get("tokens")
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise ValueError("its token ids are not a list of integers")
        if not isinstance(meta.get("policy"), dict):
            raise ValueError("it names no KV policy")

    def name(self, entry: Entry) -> Path:
        key = json.dumps([entry.policy.to_dict(), entry.tokens], sort_keys=True)
        digest = hashlib.sha256(key.encode()).hexdigest()[:32]
        return self.folder / f"{FILE_PREFIX}{digest}.safetensors"

    def put(self, entry: Entry) -> None:
        """Write ``entry`` (replacing a file of the same tokens), then trim to the limit."""
        if not self.writable:
            return
        path = self.name(entry)
        meta = dict(self.identity, policy=entry.policy.to_dict())
        save_held(path, entry.caches, entry.tokens, entry.checkpoint, meta)
        size = path.stat().st_size
        self.files[path] = DiskFile(
            path, entry.policy.to_dict(), list(entry.tokens), size, time.time()
        )
        self._trim()

    def _trim(self) -> None:
        while self.nbytes > self.limit and self.files:
            oldest = min(self.files.values(), key=lambda f: f.used)
            del self.files[oldest.path]
            if OWN_FILE.fullmatch(oldest.path.name):
                self._remove(oldest.path)

    def _remove(self, path: Path, why: str | None = None) -> None:
        try:
            path.unlink()
        except OSError as e:
            self.log(f"prefix cache: cannot remove {path.name}: {e}")
            return
        if why:
            self.log(f"prefix cache: removed {path.name} ({why})")

    def best(self, policy: KVPolicy, ids: list[int]) -> DiskFile | None:
        want = policy.to_dict()
        scored = [
            (common_prefix(f.tokens, ids[:-1]), f) for f in self.files.values() if f.policy == want
        ]
        scored = [s for s in scored if s[0] >= MIN_REUSE]
        return max(scored, key=lambda s: s[0])[1] if scored else None

    def load(self, f: DiskFile, model, policy: KVPolicy) -> Entry | None:
        """The entry in ``f``, checked in full before MLX reads it; None (with a log line)
        for a file that fails a check (it is then forgotten, not deleted)."""
        identity = dict(self.identity, policy=policy.to_dict())
        try:
            caches, tokens, cp = load_held(f.path, identity, model, policy)
        except Exception as e:
            self.log(f"prefix cache: skipped {f.path.name}: {first_line(e)}")
            self.files.pop(f.path, None)
            return None
        f.used = time.time()
        try:
            os.utime(f.path)
        except OSError:
            pass
        self.hits += 1
        return Entry(policy, tokens, caches, cp)


class PrefixCache:
    """Finished requests' caches by policy, in memory and on disk (module docstring)."""

    def __init__(
        self,
        limit: int,
        model=None,
        disk: DiskTier | None = None,
        log: Callable[[str], None] = lambda _m: None,
        count: Callable[[int], int] | None = None,
    ):
        self.limit = limit
        # An entry's bytes as every rank counts them: the ranks of a split model hold
        # unequal shares and count the largest, so that they evict the same entries.
        self.count = count or (lambda nbytes: nbytes)
        self.model = model
        self.disk = disk
        self.log = log
        self.entries: list[Entry] = []
        self.hits = self.misses = self.tokens_reused = 0
        self._last_failure = ""

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    # -- taking ------------------------------------------------------------------------------
    def take(self, policy: KVPolicy, ids: list[int]) -> tuple[int, list | None]:
        """(tokens held, caches) for a new request with prompt ``ids``: a copy of the best
        entry's caches, holding that many of its tokens; (0, None) on a miss."""
        from mlxkv.caches import copy_caches

        mine = [e for e in self.entries if e.policy == policy]
        mine.sort(key=lambda e: e.bound(ids), reverse=True)
        for e in mine[:TRIES]:
            if e.bound(ids) < MIN_REUSE:
                break
            held, caches = self._try(e, ids, copy_caches)
            if held >= MIN_REUSE:
                return self._hit(e, held, caches)
        if self.disk is not None and self.model is not None:
            while (f := self.disk.best(policy, ids)) is not None:
                e = self.disk.load(f, self.model, policy)
                if e is None:
                    continue  # damaged, now forgotten: the next best file may hold the prompt
                self._add(e)
                self.make_room(0)
                held, caches = self._try(e, ids, copy_caches)
                if held >= MIN_REUSE:
                    return self._hit(e, held, caches)
                break
        self.misses += 1
        return 0, None

    def _try(self, e: Entry, ids: list[int], copy_caches) -> tuple[int, list | None]:
        caches, tokens = copy_caches(e.caches), list(e.tokens)
        held = keep_prefix(caches, tokens, e.checkpoint, ids)
        return (held or 0), caches

    def _hit(self, e: Entry, held: int, caches: list) -> tuple[int, list]:
        e.used = next(_USES)
        self.hits += 1
        self.tokens_reused += held
        return held, caches

    # -- keeping -----------------------------------------------------------------------------
    def put(self, policy: KVPolicy, tokens: list[int], caches: list, checkpoint=None) -> None:
        """Keep ``caches`` (holding ``tokens``; no longer used by any request)."""
        from mlxkv.caches import trimmable

        if not tokens or self.limit <= 0:
            return
        e = Entry(policy, list(tokens), caches, checkpoint)
        self._add(e)
        # an older entry this one can reproduce (it trims back to it, or its copy is it) goes
        older = []  # the earlier turns of this conversation, oldest first
        for old in [o for o in self.entries if o is not e and o.policy == policy]:
            n = len(old.tokens)
            if n <= len(tokens) and tokens[:n] == old.tokens:
                drop = len(tokens) - n
                if all(trimmable(c) >= drop for c in caches) or (
                    checkpoint is not None and checkpoint.tokens == old.tokens
                ):
                    self.entries.remove(old)
                else:
                    older.append(old)
        # a window or quantized cache cannot trim back: its earlier turns stay for a client
        # that edits or regenerates one of them, the last few only (an agent's long session
        # otherwise filled the tier with one entry per turn)
        older.sort(key=lambda o: len(o.tokens))
        for old in older[: max(len(older) - EARLIER_TURNS, 0)]:
            self.entries.remove(old)
        self.make_room(0)

    def _add(self, e: Entry) -> None:
        for c in e.caches:
            if hasattr(c, "drop_scratch"):
                c.drop_scratch()
        e.nbytes = self.count(sum(c.nbytes for c in e.caches))
        if e.checkpoint is not None:
            e.nbytes += e.checkpoint.nbytes
        same = [o for o in self.entries if o.policy == e.policy and o.tokens == e.tokens]
        self.entries = [o for o in self.entries if not any(o is x for x in same)]
        self.entries.append(e)

    def make_room(self, need: int) -> int:
        """Free memory until the entries fit the limit and ``need`` bytes are freed;
        returns the bytes freed. Turn-boundary copies go first, least recently used first
        (an entry without one still serves every prompt that extends it, the common case),
        then whole entries, least recently used first (to disk)."""
        freed = 0
        while self.entries and (self.nbytes > self.limit or freed < need):
            copies = [e for e in self.entries if e.checkpoint is not None]
            if copies:
                e = min(copies, key=lambda x: x.used)
                size = e.checkpoint.nbytes
                e.checkpoint = None
                e.nbytes -= size
                freed += size
                continue
            e = min(self.entries, key=lambda x: x.used)
            self.entries.remove(e)
            freed += e.nbytes
            self._spill(e)
        return freed

    def _spill(self, e: Entry) -> None:
        if self.disk is None:
            return
        try:
            self.disk.put(e)
        except Exception as err:  # a full disk must not stop the server
            line = f"prefix cache: could not write an entry to disk: {err}"
            if line != self._last_failure:  # once per cause, not once per request
                self.log(line)
            self._last_failure = line

    def flush(self) -> None:
        """Write every memory entry to disk (the server is stopping)."""
        for e in sorted(self.entries, key=lambda x: x.used):
            self._spill(e)

    def status(self) -> dict:
        d = self.disk
        return {
            "entries": len(self.entries),
            "bytes": self.nbytes,
            "limit_bytes": self.limit,
            "hits": self.hits,
            "misses": self.misses,
            "tokens_reused": self.tokens_reused,
            "disk": {
                "entries": len(d.files) if d else 0,
                "bytes": d.nbytes if d else 0,
                "limit_bytes": d.limit if d else 0,
                "hits": d.hits if d else 0,
                "dir": str(d.folder) if d else None,
            },
        }
