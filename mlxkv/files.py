"""Reading and writing files a user (or anyone) may have crafted, safely.

Writes: :func:`atomic_write` is the one way mlxkv replaces a file. The new content goes to
a temporary file created exclusively (``O_CREAT|O_EXCL``, an unpredictable name) in the
target's folder, is fsynced, gets the mode of the file it replaces, and is renamed over
the target: a link planted at a temporary name is never followed, and readers see the
old file or the new one, whole. A file the user made read-only is refused, not replaced.

Reads: :func:`read_bytes` / :func:`read_text` accept regular files only (a FIFO, a device
such as ``/dev/zero`` or a folder is refused without blocking) and refuse a file larger
than the caller's limit before reading it. :func:`parse_json` refuses nesting deeper than
a limit (before parsing: no RecursionError anywhere later) and, when asked, strings that
cannot be encoded as UTF-8 (lone surrogates such as ``\\ud800``).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import re
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from itertools import pairwise
from pathlib import Path

from mlxkv.errors import UserError, first_line, one_line

MiB = 1 << 20
JSON_DEPTH = 64  # deeper nesting than any config, message list or batch line needs


# -- writing -----------------------------------------------------------------------------


def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


def _check_target(path: Path, what: str, overwrite: bool) -> int | None:
    """The mode to give the new file when it replaces ``path`` (None: a new file)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UserError(f"{what} {path}: cannot write it ({e.strerror})") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise UserError(f"{what} {path} is {kind}; name a regular file or a new one")
    if not overwrite:
        raise UserError(f"{what} {path} exists; choose a new file name")
    if not st.st_mode & stat.S_IWUSR or not os.access(path, os.W_OK):
        raise UserError(
            f"{what} {path} is read-only; make it writable (chmod u+w) or name another file"
        )
    return stat.S_IMODE(st.st_mode)


@contextlib.contextmanager
def atomic_file(
    path, what: str = "file", overwrite: bool = True, new_mode: int | None = None
) -> Iterator[io.BufferedWriter]:
    """A binary file object whose content replaces ``path`` when the block ends without
    an exception (else ``path`` is untouched and the temporary file is removed). A file it
    replaces keeps its mode; a new one gets ``new_mode`` (None: the umask's).

    Every failure (missing folder, full disk, read-only target) is a one-line
    :class:`UserError` naming ``what`` (e.g. ``"--prompt-cache"``) and the path."""
    path = Path(path)
    mode = _check_target(path, what, overwrite)
    folder = path.parent
    if not folder.is_dir():
        raise UserError(f"{what} {path}: the folder {folder} does not exist; create it first")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as e:
        raise UserError(f"{what} {path}: cannot write in {folder} ({e.strerror})") from None
    done = False
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
            if mode is None:
                mode = new_mode if new_mode is not None else 0o666 & ~_umask()
            os.fchmod(f.fileno(), mode)
        if overwrite:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # fails rather than replace a file created meanwhile
            os.unlink(tmp)
        done = True
        with contextlib.suppress(OSError):
            dfd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
    except FileExistsError:
        raise UserError(f"{what} {path} exists; choose a new file name") from None
    except OSError as e:
        raise UserError(f"{what} {path}: cannot write it ({e.strerror or e})") from None
    finally:
        if not done:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def atomic_write(
    path, data: bytes | str, what: str = "file", overwrite: bool = True, new_mode: int | None = None
) -> None:
    """Replace ``path`` with ``data`` (str is written as UTF-8); see :func:`atomic_file`."""
    with atomic_file(path, what, overwrite, new_mode) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def atomic_write_with(path, write: Callable[[io.BufferedWriter], None], **kw) -> None:
    """Replace ``path`` with what ``write(file_object)`` writes; see :func:`atomic_file`."""
    with atomic_file(path, **kw) as f:
        write(f)


def write_fd(fd: int, data: bytes) -> None:
    """All of ``data`` written to the open file ``fd``, fsynced; ``fd`` is closed."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_folder(folder: Path) -> None:
    """A file created, renamed or removed in ``folder`` stays so after a crash."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FolderBusy(Exception):
    """Another process owns the folder."""


def lock_folder(folder: Path) -> io.TextIOWrapper:
    """``folder`` (created if missing, private to the user) owned by this process while the
    returned file stays open: an exclusive lock on its ``.lock`` file; :class:`FolderBusy`
    when another process holds it."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = open(folder / ".lock", "a")  # (append: an existing one is kept)
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise FolderBusy(f"{folder} is in use by another mlxkv server") from None
    return lock


class OwnedFolder:
    """A folder of files a server keeps, owned by this process until :meth:`close` (see
    :func:`lock_folder`); ``log`` takes a line about a file it skips."""

    def __init__(self, folder, log: Callable[[str], None]):
        self.folder = Path(folder)
        self.log = log
        self._lock = lock_folder(self.folder)

    def close(self) -> None:
        self._lock.close()  # (closing releases the lock)

    def write_json(self, name: str, obj) -> None:
        """The folder's file ``name`` replaced whole by ``obj`` as JSON (see
        :func:`atomic_write`), readable by its owner alone; an OSError says why it could
        not be."""
        try:
            atomic_write(self.folder / name, json.dumps(obj), new_mode=0o600)
        except UserError as e:
            raise OSError(first_line(e)) from None


# -- reading -----------------------------------------------------------------------------


def _size(n: int) -> str:
    return f"{n / MiB:.2f}".rstrip("0").rstrip(".") + " MiB" if n >= MiB else f"{n} bytes"


def _over(size: int, limit: int) -> str:
    """'1.05 MiB, more than the 1 MiB allowed', in bytes where the MiB would read the same."""
    a, b = _size(size), _size(limit)
    if a == b:
        a, b = f"{size:,} bytes", f"{limit:,} bytes"
    return f"{a}, more than the {b} allowed"


def open_regular(path, what: str = "file"):
    """``path`` opened for binary reading if it is a regular file (without blocking on a
    FIFO), else a one-line :class:`UserError`. Returns ``(file, size)``."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise UserError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise UserError(f"{what} {path} is a directory, not a file") from None
    except OSError as e:
        raise UserError(f"{what} {path}: cannot read it ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise UserError(f"{what} {path} is {kind}; name a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb"), st.st_size


def shared_bytes(ranges: dict) -> tuple | None:
    """Two names whose byte ranges ``{name: (start, end)}`` overlap, else None: a file's
    table that names the same bytes many times (a small file that would load as
    gigabytes)."""
    ordered = sorted(ranges.items(), key=lambda kv: kv[1])
    for (a, (_, end)), (b, (start, _)) in pairwise(ordered):
        if start < end:
            return a, b
    return None


def check_file(path, limit: int, what: str = "file") -> None:
    """Refuse (one line) ``path`` unless it is a regular file of at most ``limit`` bytes:
    for a file another library will read."""
    f, size = open_regular(path, what)
    f.close()
    if size > limit:
        raise UserError(f"{what} {path} is {_over(size, limit)}")


def read_bytes(path, limit: int, what: str = "file") -> bytes:
    """The bytes of the regular file ``path``, refused (one line) above ``limit`` bytes."""
    f, size = open_regular(path, what)
    with f:
        if size > limit:
            raise UserError(f"{what} {path} is {_over(size, limit)}")
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise UserError(f"{what} {path}: cannot read it ({e.strerror})") from None
    if len(data) > limit:  # it grew while we read
        raise UserError(f"{what} {path} is more than the {_size(limit)} allowed")
    return data


def read_text(path, limit: int, what: str = "file") -> str:
    """:func:`read_bytes` decoded as UTF-8, without the byte-order mark some editors write
    first (one-line error when it is not UTF-8)."""
    data = read_bytes(path, limit, what)
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {path} is not UTF-8 text (byte {e.start})") from None


def read_stdin(limit: int, what: str, closed: str) -> bytes:
    """At most ``limit`` bytes of stdin, refused (one line) when longer or unreadable;
    ``closed`` says what to do when stdin is closed."""
    if sys.stdin is None or sys.stdin.closed:
        raise UserError(closed)
    try:
        data = sys.stdin.buffer.read(limit + 1)
    except (OSError, ValueError, AttributeError) as e:
        raise UserError(f"cannot read {what} from stdin: {one_line(e)}") from None
    if len(data) > limit:
        raise UserError(f"{what} on stdin is more than the {_size(limit)} allowed; split it")
    return data


# Strings once their escapes are gone: a pattern without a repeated group, for which re
# keeps no backtracking frame per character (r'"(?:[^"\\]|\\.)*"' took ~120 bytes each).
_STRING = re.compile(r'"[^"]*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(text: str) -> int:
    """How deep the arrays and objects of the JSON ``text`` nest (strings skipped)."""
    import numpy as np

    if '"' in text:
        # escaped backslashes go first, so that what is left of \" is always an escaped quote
        text = _STRING.sub("", text.replace("\\\\", "").replace('\\"', ""))
    brackets = text.encode("utf-8", "surrogatepass").translate(None, _NOT_BRACKETS)
    data = np.frombuffer(brackets, np.uint8)
    deepest = depth = 0
    for start in range(0, len(data), 1 << 20):  # in slices: a few MB of work arrays at most
        part = data[start : start + (1 << 20)]
        opens = ((part == ord("[")) | (part == ord("{"))).astype(np.int8)
        levels = np.cumsum(opens * 2 - 1, dtype=np.int64) + depth
        deepest, depth = max(deepest, int(levels.max())), int(levels[-1])
    return deepest


def utf8_problem(value) -> str | None:
    """The first string inside ``value`` (parsed JSON) that UTF-8 cannot encode (a lone
    surrogate such as ``\\ud800``), shown escaped; None when every string is fine."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                return ascii(v[e.start : e.end])
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return None


def parse_json(text: str, what: str, max_depth: int = JSON_DEPTH, utf8: bool = False):
    """``json.loads(text)`` with one-line :class:`UserError` for bad JSON, nesting deeper
    than ``max_depth``, and (``utf8=True``) strings with lone surrogates."""
    if json_depth(text) > max_depth:
        raise UserError(f"{what} nests arrays/objects deeper than {max_depth} levels")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(
            f"{what} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        ) from None
    except RecursionError:  # json_depth should have caught it
        raise UserError(f"{what} nests arrays/objects too deeply") from None
    if utf8:
        bad = utf8_problem(value)
        if bad:
            raise UserError(f"{what} holds {bad}, a lone surrogate that is not valid text")
    return value


def check_text(text: str, what: str) -> str:
    """``text`` if UTF-8 can encode it, else a one-line :class:`UserError`."""
    bad = utf8_problem(text)
    if bad:
        raise UserError(f"{what} holds {bad}, a lone surrogate that is not valid text")
    return text


def inside(path, root) -> bool:
    """Whether ``path`` (resolved, links followed) lies inside ``root`` (resolved)."""
    try:
        Path(os.path.realpath(path)).relative_to(os.path.realpath(root))
    except ValueError:
        return False
    return True


def safe_name(name: str, what: str = "name") -> str:
    """``name`` as a single path component for a folder under mlxkv's home: no separators,
    no ``..``, nothing that could lead outside. Refused (one line) otherwise."""
    if (
        not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or name.startswith(".")
    ):
        raise UserError(f"{what} {name!r} cannot name a folder; use letters, digits, - _ .")
    return name
