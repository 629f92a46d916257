"""mlxkv.files: atomic writes that follow no planted link and keep modes; bounded reads."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from mlxkv.cli import main
from mlxkv.errors import UserError
from mlxkv.files import (
    atomic_write,
    inside,
    json_depth,
    parse_json,
    read_bytes,
    read_text,
    safe_name,
)


def test_atomic_write_replaces_whole_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    atomic_write(target, b"new content")
    assert target.read_bytes() == b"new content"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]


def test_atomic_write_follows_no_link_planted_at_old_temporary_names(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    target = tmp_path / "x.png"
    # the names the old code used: .NAME.PID.tmp and .NAME.PID.tmp.safetensors
    for name in (f".x.png.{os.getpid()}.tmp", f".x.png.{os.getpid()}.tmp.safetensors"):
        (tmp_path / name).symlink_to(victim)
    atomic_write(target, b"chart")
    assert victim.read_bytes() == b"precious"
    assert target.read_bytes() == b"chart"


def test_atomic_write_keeps_the_mode_of_the_file_it_replaces(tmp_path):
    target = tmp_path / "cache.bin"
    target.write_bytes(b"old")
    target.chmod(0o600)
    atomic_write(target, b"new")
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


def test_new_file_gets_the_umask_mode(tmp_path):
    old = os.umask(0o027)
    try:
        atomic_write(tmp_path / "new.bin", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.bin").stat().st_mode) == 0o640


def test_read_only_file_is_refused_not_replaced(tmp_path):
    target = tmp_path / "ro.bin"
    target.write_bytes(b"keep me")
    target.chmod(0o444)
    with pytest.raises(UserError, match="read-only") as e:
        atomic_write(target, b"new", what="--prompt-cache")
    assert "\n" not in str(e.value)
    assert target.read_bytes() == b"keep me"
    assert stat.S_IMODE(target.stat().st_mode) == 0o444


def test_missing_folder_and_link_target_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        atomic_write(tmp_path / "nope" / "f.bin", b"x", what="--prompt-cache")
    victim = tmp_path / "victim"
    victim.write_bytes(b"v")
    (tmp_path / "link.bin").symlink_to(victim)
    with pytest.raises(UserError, match="symbolic link"):
        atomic_write(tmp_path / "link.bin", b"x")
    assert victim.read_bytes() == b"v"


def test_no_overwrite_refuses_an_existing_file(tmp_path):
    target = tmp_path / "chart.png"
    target.write_bytes(b"mine")
    with pytest.raises(UserError, match="exists"):
        atomic_write(target, b"x", overwrite=False)
    assert target.read_bytes() == b"mine"


def test_write_error_at_the_os_boundary_leaves_target_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "c.bin"
    target.write_bytes(b"old")

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(UserError, match="No space left on device"):
        atomic_write(target, b"new", what="--prompt-cache")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.bin"]


def test_reads_refuse_fifo_device_folder_and_oversize_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match="not a regular file"):
        read_text(fifo, 1 << 20, "config")
    with pytest.raises(UserError, match="not a regular file"):
        read_bytes("/dev/zero", 1 << 20, "config")
    with pytest.raises(UserError, match="is a directory"):
        read_bytes(tmp_path, 1 << 20, "config")
    big = tmp_path / "big"
    big.write_bytes(b"x" * 2000)
    with pytest.raises(UserError, match="more than the 1000 bytes allowed"):
        read_bytes(big, 1000, "config")
    with pytest.raises(UserError, match="not UTF-8"):
        (tmp_path / "bin").write_bytes(b"\xff\xfe")
        read_text(tmp_path / "bin", 100, "config")


def test_a_byte_order_mark_is_not_part_of_the_text(tmp_path):
    from mlxkv.commands.batch_input import Job, read_input

    (tmp_path / "schema.json").write_bytes(b'\xef\xbb\xbf{"type": "string"}')
    assert read_text(tmp_path / "schema.json", 100, "--json-schema") == '{"type": "string"}'
    (tmp_path / "in.jsonl").write_bytes(b'\xef\xbb\xbf{"id": 1, "prompt": "hi"}\r\n')
    (job,) = read_input(tmp_path / "in.jsonl")
    assert isinstance(job, Job) and job.prompt == "hi"


def test_parse_json_refuses_deep_nesting_and_lone_surrogates():
    with pytest.raises(UserError, match="deeper than 64"):
        parse_json("[" * 100000 + "]" * 100000, "--messages")
    assert parse_json('{"a": "[[[[["}', "x") == {"a": "[[[[["}
    with pytest.raises(UserError, match="lone surrogate"):
        parse_json('[{"content": "\\ud800"}]', "--messages", utf8=True)
    assert parse_json('"\\ud83d\\ude00"', "x", utf8=True) == "\U0001f600"
    with pytest.raises(UserError, match="not valid JSON"):
        parse_json("{", "x")


@pytest.mark.parametrize(
    "text, depth",
    [
        ('{"a": "[\\"]"}', 1),  # an escaped quote does not end the string
        ('["\\\\", ["]"]]', 2),  # an escaped backslash does not escape the quote
        ('["\\\\\\"["]', 1),
        ('[["\\u005b"]]', 2),
        ("[[]][[[]]]", 3),
        ('"{"', 0),
        ("", 0),
    ],
)
def test_json_depth_skips_strings_and_their_escapes(text, depth):
    assert json_depth(text) == depth


@pytest.mark.parametrize(
    "part, between", [("x", '"'), ("\\n", '"'), ("[1],", "")], ids=["string", "escapes", "lists"]
)
def test_json_depth_of_a_long_text_takes_memory_of_its_size(part, between):
    """A 32 MB line of one string (of escapes, of short lists) is read in a few copies of its
    size: a regex with a repeated group kept ~120 bytes per character (4 GB here)."""
    import tracemalloc

    text = "[" + between + part * (32_000_000 // len(part)) + between + "[]]"
    tracemalloc.start()
    try:
        assert json_depth(text) == 2
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(text), peak


def test_safe_name_and_inside(tmp_path):
    for bad in ("../../../victim", "..", "a/b", "", ".hidden"):
        with pytest.raises(UserError):
            safe_name(bad, "alias")
    assert safe_name("llama3.1-8b") == "llama3.1-8b"
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "out").symlink_to(tmp_path)
    assert inside(tmp_path / "home" / "a", tmp_path / "home")
    assert not inside(tmp_path / "home" / "out" / "x", tmp_path / "home")


# -- the writers that use it ---------------------------------------------------------------

DATA = Path(__file__).parent / "data"
LLAMA_MAC = str(DATA / "configs" / "mac" / "llama-3.1-8b-instruct-4bit.json")
LLAMA = DATA / "configs" / "published" / "llama-2-7b.json"


def _plant_links(folder: Path, name: str, victim: Path) -> None:
    """Links at every temporary name the writers used to derive from the pid."""
    for pid in range(os.getpid() - 5, os.getpid() + 200):
        for pattern in (f".{name}.{pid}.tmp", f".{name}.{pid}.tmp.safetensors"):
            (folder / pattern).symlink_to(victim)


def test_plan_chart_follows_no_planted_link(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("MLXKV_HOME", str(tmp_path / "home"))
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    out = tmp_path / "out"
    out.mkdir()
    _plant_links(out, "x.png", victim)
    argv = [
        "plan",
        LLAMA_MAC,
        "--backend",
        "metal",
        "--memory",
        "16GB",
        "--context",
        "8192",
        "--chart",
    ]
    assert main([*argv, str(out / "x.png")]) == 0
    assert victim.read_bytes() == b"precious"
    assert (out / "x.png").read_bytes()[:4] == b"\x89PNG"


def test_layouts_cache_follows_no_planted_link_and_survives_deep_json(tmp_path, monkeypatch):
    from mlxkv.memory import store

    monkeypatch.setenv("MLXKV_HOME", str(tmp_path / "home"))
    cfg = json.loads(LLAMA.read_text())
    path = tmp_path / "home" / "layouts" / f"{store._key(cfg)}.json"
    path.parent.mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    for pid in range(os.getpid() - 5, os.getpid() + 200):
        path.with_suffix(f".{pid}.tmp").symlink_to(victim)
    first = store.layout_for(cfg)
    assert victim.read_bytes() == b"precious"
    path.write_text("[" * 200000 + "]" * 200000)  # a crafted cache: deep, not a layout
    assert store.layout_for(cfg) == first
    path.unlink()
    path.symlink_to(victim)  # a link at the cache's own name: read as garbage, not written
    assert store.layout_for(cfg) == first
    assert victim.read_bytes() == b"precious"


@pytest.mark.parametrize(
    "entry, words",
    [
        ({"w": {"shape": [2], "data_offsets": [0, 4]}}, "has no dtype safetensors defines"),
        ({"w": {"dtype": "X99", "shape": [2], "data_offsets": [0, 4]}}, "(got 'X99')"),
        ({"w": {"dtype": "F16", "shape": ["a"], "data_offsets": [0, 4]}}, "a shape that is not"),
        ({"w": {"dtype": "F16", "shape": [-2], "data_offsets": [0, 4]}}, "a shape that is not"),
        ({"w": {"dtype": "F16", "shape": [2], "data_offsets": [4, 0]}}, "no valid data_offsets"),
        ({"w": {"dtype": "F16", "shape": [9], "data_offsets": [0, 4]}}, "do not match its shape"),
        ({"w": [1, 2]}, "is not a table"),
        (
            {"w": {"dtype": "F16", "shape": [2**62] * 20000, "data_offsets": [0, 4]}},
            "has 20000 dimensions; weights have at most 8",
        ),
        (
            {
                "w": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},
                "v": {"dtype": "F16", "shape": [1], "data_offsets": [2, 4]},
            },
            "tensors 'w' and 'v' share bytes",
        ),
        ({}, "holds no tensors"),
        (
            {
                f"w{i}": {"dtype": "F16", "shape": [0], "data_offsets": [0, 0]}
                for i in range(1 << 18 | 1)
            },
            "names more than 262,144 tensors; a model's weight file holds far fewer",
        ),
    ],
)
def test_a_crafted_weight_table_is_one_line_in_plan_and_generate(tmp_path, capsys, entry, words):
    """A missing dtype was a KeyError traceback; a negative shape planned -0.00 GiB of
    weights, and an empty table 0, as fitting."""
    import json
    import shutil
    import struct

    from tests.bad_input import refused

    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(LLAMA, folder / "config.json")
    table = json.dumps(entry).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(table)) + table + bytes(4))
    for command in ("plan", "generate"):
        args = [str(folder)] if command == "plan" else ["--model", str(folder), "-p", "hi"]
        line = refused(capsys, command, *args)
        assert line.startswith(f"mlxkv {command}: error: {folder / 'model.safetensors'}")
        assert words in line


@pytest.mark.parametrize(
    "name, kind, words",
    [
        ("generation_config.json", "fifo", "is not a regular file; name a regular file"),
        ("tokenizer.json", "fifo", "is not a regular file; name a regular file"),
        ("tokenizer.json", 300 << 20, "is 300 MiB, more than the 256 MiB allowed"),
        ("chat_template.jinja", 5 << 20, "is 5 MiB, more than the 4 MiB allowed"),
        ("tokenizer_config.json", "folder", "is a directory; name a regular file"),
    ],
)
def test_a_model_file_that_is_no_file_or_huge_is_refused_before_it_is_read(
    tmp_path, capsys, default_model_path, name, kind, words
):
    """A FIFO generation_config.json or tokenizer.json blocked the load for ever; a 2 GiB
    generation_config.json took 4.3 GB and was then ignored."""
    from tests.bad_input import refused

    folder = tmp_path / "model"
    folder.mkdir()
    for f in default_model_path.iterdir():
        if f.name != name:
            (folder / f.name).symlink_to(f)
    target = folder / name
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "folder":
        target.mkdir()
    else:
        with open(target, "wb") as f:
            f.truncate(kind)  # sparse: no disk taken
    line = refused(capsys, "generate", "--model", str(folder), "-p", "hi", "--max-tokens", "1")
    assert line.startswith(f"mlxkv generate: error: the model's file {target}")
    assert line.endswith(words)


def test_a_tokenizer_that_panics_is_one_line(tmp_path, capsys, default_model_path):
    """A tokenizer.json whose regex passes Oniguruma's backtracking limit made the Rust
    tokenizer panic: a 138-line traceback (pyo3's PanicException is no Exception)."""
    from tests.bad_input import refused

    folder = tmp_path / "model"
    folder.mkdir()
    for f in default_model_path.iterdir():
        if f.name != "tokenizer.json":
            (folder / f.name).symlink_to(f)
    spec = json.loads((default_model_path / "tokenizer.json").read_text())
    split = {"type": "Split", "pattern": {"Regex": "(a|aa)+$"}, "behavior": "Isolated"}
    spec["pre_tokenizer"]["pretokenizers"].insert(0, {**split, "invert": False})
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    line = refused(capsys, "generate", "--model", str(folder), "-p", "a" * 40 + "b")
    assert line == (
        "mlxkv generate: error: the model's tokenizer failed on this text: PanicException: "
        "Onig: Regex search error: retry-limit-in-match over"
    )


def test_a_weight_table_past_safetensors_limit_is_refused_unread(tmp_path, capsys):
    """A table longer than safetensors' own 100 MB (a sparse file here) is refused from its
    length alone."""
    import shutil
    import struct

    from tests.bad_input import refused

    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(LLAMA, folder / "config.json")
    weights = folder / "model.safetensors"
    with open(weights, "wb") as f:
        f.write(struct.pack("<Q", 100_000_001))
        f.truncate(8 + 100_000_001)
    line = refused(capsys, "plan", str(folder))
    assert line == (
        f"mlxkv plan: error: {weights} has a table of 100,000,001 bytes, more than the "
        "100,000,000 safetensors allows (an interrupted download? delete it and download the "
        "model again)"
    )
