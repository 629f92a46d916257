"""Crafted or unwritable ``--prompt-cache`` files: checked before MLX sees them, one line.

A cache file is made once per policy by a real session on the default model; each case
edits one thing in a copy and expects a one-line CacheError, with the file unchanged and
the session as it was. The native crash (an offset of 10**9) runs in a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import mlx.core as mx
import pytest

from mlxkv.caches import CacheError
from mlxkv.caches.persist import data_digest
from mlxkv.engine.session import GenerationSettings, Session
from mlxkv.errors import UserError
from mlxkv.policy import KVPolicy
from tests.bad_input import refused
from tests.conftest import run_cli

WINDOW = KVPolicy(window=64, sinks=4, bits=4)  # KIVI ring + a turn-boundary copy


@pytest.fixture(scope="module")
def saved(default_model, tmp_path_factory):
    """{policy name: (file, tokens)} made by real sessions."""
    out = {}
    folder = tmp_path_factory.mktemp("caches")
    for name, policy in (("full", KVPolicy()), ("window", WINDOW)):
        gen = Session(default_model, policy)
        for prompt in ("Hello there, how are you today?", "word " * 90):
            for _ in gen.run(prompt, GenerationSettings(max_tokens=4, prefill_step=32)):
                pass
        path = folder / f"{name}.safetensors"
        gen.save_cache(path)
        out[name] = (path, list(gen.tokens))
    return out


def _edit(src, dst, arrays=None, meta=None, caller=None):
    """A copy of cache file ``src`` at ``dst`` with arrays / string metadata / the caller's
    metadata (the JSON in '0.metadata') changed by the given functions. Edited arrays get
    the digest of their data, as a crafted file may: every check after it must hold."""
    a, m = mx.load(str(src), return_metadata=True)
    if caller is not None:
        c = json.loads(m["0.metadata"])
        caller(c)
        m["0.metadata"] = json.dumps(c)
    if arrays is not None:
        arrays(a)
        scalars = {v for k, v in m.items() if re.fullmatch(r"2\.\d+\.0", k)}
        m["0.digest"] = data_digest({k: v for k, v in a.items() if k not in scalars})
    if meta is not None:
        meta(m)
    mx.save_safetensors(str(dst), a, m)
    return dst


def _set(name, value):
    return lambda a: a.__setitem__(name, mx.array(value))


CASES = {
    "digest missing": ("full", dict(meta=lambda m: m.pop("0.digest")), "it has no digest of its"),
    "metadata not JSON": (
        "full",
        dict(meta=lambda m: m.__setitem__("0.metadata", "{not json")),
        "its metadata is not valid JSON",
    ),
    "metadata nested deeply": (
        "full",
        dict(meta=lambda m: m.__setitem__("0.metadata", "[" * 5000 + "]" * 5000)),
        "nests arrays/objects deeper than 8 levels",
    ),
    "offset a string": ("full", dict(arrays=_set("0.2", [ord("x")])), "scalar 0.2 is not a scalar"),
    "offset of 10**6": ("full", dict(arrays=_set("0.2", 10**6)), "offset 1000000 is past the end"),
    "offset negative": ("full", dict(arrays=_set("0.2", -5)), "layer 0: offset is -5"),
    "a layer dropped": (
        "full",
        dict(meta=lambda m: m.pop("1.29")),
        "tensor 29.0 belongs to no layer",
    ),
    "keys of another head size": (
        "full",
        dict(arrays=lambda a: a.__setitem__("3.0", mx.zeros((1, 3, 256, 32)))),
        "layer 3: 0 has shape [1, 3, 256, 32]; this model needs [1, 3, 256, 64]",
    ),
    "keys of another dtype": (
        "full",
        dict(arrays=lambda a: a.__setitem__("3.1", a["3.1"].astype(mx.float16))),
        "layer 3: 1 is mlx.core.float16",
    ),
    "layers edited": ("full", dict(caller=lambda c: c.__setitem__("layers", 5)), "layers=5"),
    "tokens shorter": (
        "full",
        dict(caller=lambda c: c.__setitem__("tokens", c["tokens"][:-3])),
        "tokens, its caches hold",
    ),
    "tokens longer": (
        "full",
        dict(caller=lambda c: c.__setitem__("tokens", c["tokens"] + [5, 6])),
        "tokens, its caches hold",
    ),
    "token id outside the vocabulary": (
        "full",
        dict(caller=lambda c: c["tokens"].__setitem__(0, 10**9)),
        "its tokens are not token ids of this model (0 to 49151)",
    ),
    "tokens not a list": (
        "full",
        dict(caller=lambda c: c.__setitem__("tokens", "abc")),
        "its tokens are not token ids",
    ),
    "unknown cache class": (
        "full",
        dict(meta=lambda m: m.__setitem__("1.0", "ChunkedKVCache")),
        "unknown cache class 'ChunkedKVCache'",
    ),
    "another model's policy": (
        "window",
        dict(caller=lambda c: c["policy"].__setitem__("window", 65)),
        "was made with policy=",
    ),
    "window counters past the ring": (
        "window",
        dict(arrays=_set("0.tokens_seen", 10**9)),
        "layer 0: it keeps 999999",
    ),
    "window edited in the state": (
        "window",
        dict(arrays=_set("0.window", 4096)),
        "layer 0: window is 4096, this policy has 64",
    ),
    "packed values of two lengths": (
        "window",
        dict(arrays=lambda a: a.__setitem__("0.values.1", a["0.values.1"][:, :, :-1])),
        "layer 0: the parts of a packed buffer disagree",
    ),
    "values fewer than the ring": (
        "window",
        dict(
            arrays=lambda a: [
                a.__setitem__(f"0.values.{i}", a[f"0.values.{i}"][:, :, :-1]) for i in range(3)
            ]
        ),  # fmt: skip
        "layer 0: its values are fewer than its counters say",
    ),
    "residual of more rows than a group": (
        "window",
        dict(arrays=lambda a: a.__setitem__("0.residual", mx.zeros((1, 3, 65, 64)))),
        "layer 0: its residual group has the wrong size",
    ),
    "checkpoint of another length": (
        "window",
        dict(caller=lambda c: c.__setitem__("checkpoint_tokens", c["checkpoint_tokens"][:-1])),
        "its turn-boundary copy holds another number of tokens",
    ),
    "checkpoint dropped from the metadata": (
        "window",
        dict(caller=lambda c: c.pop("checkpoint_tokens")),
        "its turn-boundary copy does not match its layers",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_crafted_cache_is_refused_before_mlx(saved, default_model, tmp_path, case):
    name, edits, words = CASES[case]
    src, _ = saved[name]
    path = _edit(src, tmp_path / "c.safetensors", **edits)
    before = path.read_bytes()
    gen = Session(default_model, KVPolicy() if name == "full" else WINDOW)
    with pytest.raises(CacheError) as e:
        gen.load_cache(path)
    assert "\n" not in str(e.value) and words in str(e.value), str(e.value)
    assert gen.tokens == [] and path.read_bytes() == before


def test_saved_caches_load_back(saved, default_model):
    for name, policy in (("full", KVPolicy()), ("window", WINDOW)):
        path, tokens = saved[name]
        gen = Session(default_model, policy)
        gen.load_cache(path)
        assert gen.tokens == tokens


@pytest.mark.parametrize("name", ["full", "window"])
def test_damaged_data_is_refused_by_its_digest(saved, default_model, tmp_path, name):
    """Every float of the file's data turned NaN, its header as written: the layout checks
    pass it, the digest does not (it was loaded before, and the answer was NaN's token)."""
    import numpy as np

    src, tokens = saved[name]
    data = bytearray(src.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    header = json.loads(data[8:start])
    for t in header.values():
        if isinstance(t, dict) and t.get("dtype") == "F32" and len(t["shape"]) == 4:
            lo, hi = t["data_offsets"]
            data[start + lo : start + hi] = np.full((hi - lo) // 4, np.nan, np.float32).tobytes()
    path = tmp_path / "damaged.safetensors"
    path.write_bytes(bytes(data))
    gen = Session(default_model, KVPolicy() if name == "full" else WINDOW)
    with pytest.raises(CacheError) as e:
        gen.load_cache(path)
    assert str(e.value) == (
        "damaged.safetensors is not a readable cache file (its data is damaged: it does not "
        "match the digest written with it); delete it"
    )
    assert gen.tokens == [] and path.read_bytes() == bytes(data)
    gen.load_cache(src)  # the file as written loads
    assert gen.tokens == tokens


def test_header_garbage_is_one_line(saved, default_model, tmp_path):
    src, _ = saved["full"]
    data = src.read_bytes()
    gen = Session(default_model, KVPolicy())
    for blob, words in [
        (b"\xff" * 8 + data[8:], "not a safetensors file"),
        (data[:8] + b"x" + data[9:], "header: its header is not valid JSON"),
        (data[: len(data) // 2], "does not fit the file"),
    ]:
        (tmp_path / "g.safetensors").write_bytes(blob)
        with pytest.raises(CacheError, match=words):
            gen.load_cache(tmp_path / "g.safetensors")


def test_same_name_other_model_is_refused(
    saved, default_model, default_model_path, tmp_path, capsys, monkeypatch
):
    """Two folders both called 'mdl' with different configs never share a cache file."""
    import dataclasses

    from mlxkv.models.identity import model_identity

    # Both folders link the default model's weights; a cache file is tied to the folder's
    # identity (config, weights, tokenizer), so each run gets the loaded default model
    # under the folder it asked for instead of loading the same weights twice.
    monkeypatch.setattr(
        "mlxkv.engine.loading.open_model",
        lambda model, *a, **k: dataclasses.replace(default_model, path=Path(model)),
    )

    a, b = tmp_path / "a" / "mdl", tmp_path / "b" / "mdl"
    for d in (a, b):
        d.mkdir(parents=True)
        for f in default_model_path.iterdir():
            if f.suffix == ".safetensors":
                (d / f.name).symlink_to(f)
            elif f.is_file():
                (d / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((b / "config.json").read_text())
    cfg["rms_norm_eps"] = cfg.get("rms_norm_eps", 1e-5) * 2
    (b / "config.json").write_text(json.dumps(cfg))
    assert model_identity(a) == model_identity(default_model_path)
    assert model_identity(a) != model_identity(b)
    cache = tmp_path / "c.safetensors"
    argv = ["generate", "-p", "hi", "--max-tokens", "2", "--prompt-cache", str(cache)]
    assert __import__("mlxkv.cli").cli.main([*argv, "--model", str(a)]) == 0
    before = cache.read_bytes()
    line = refused(capsys, *argv, "--model", str(b))
    assert "was made for another model (its config, weights or tokenizer differ)" in line
    assert cache.read_bytes() == before


def test_offset_of_a_billion_never_reaches_mlx(saved, tmp_path, default_model_path):
    """This one segfaulted (exit 139, no message): checked in a subprocess."""
    src, _ = saved["full"]
    path = _edit(src, tmp_path / "c.safetensors", arrays=_set("0.2", 10**9))
    before = path.read_bytes()
    p = run_cli("generate", "-p", "hi", "--max-tokens", "2", "--prompt-cache", str(path),
                "--model", str(default_model_path), timeout=300)  # fmt: skip
    assert p.returncode == 2, p.stderr[-2000:]
    errors = [x for x in p.stderr.splitlines() if ": error: " in x]
    assert len(errors) == 1 and "offset 1000000000 is past the end" in errors[0]
    assert "Traceback" not in p.stderr and path.read_bytes() == before


@pytest.mark.slow
def test_a_refused_cache_exits_cleanly_every_time(saved, tmp_path, default_model_path):
    """Without freeing MLX's streams before exit, 4 of 20 of these runs aborted after the
    error line (exit 134, "terminate called without an active exception"), with OpenBLAS
    on two threads as a user's is (the suite's one thread made it rarer)."""
    src, _ = saved["full"]
    path = _edit(src, tmp_path / "c.safetensors", arrays=_set("0.2", 10**9))
    codes = []
    for _ in range(20):
        p = run_cli("generate", "-p", "hi", "--max-tokens", "2", "--prompt-cache", str(path),
                    "--model", str(default_model_path), env={"OPENBLAS_NUM_THREADS": "2"},
                    timeout=300)  # fmt: skip
        codes.append((p.returncode, p.stderr.splitlines()[-1]))
    assert {c for c, _ in codes} == {2}, codes
    assert all("offset 1000000000 is past the end" in last for _, last in codes), codes


def test_fifo_cache_is_refused_before_the_model_loads(capsys, tmp_path, no_model):
    fifo = tmp_path / "c.safetensors"
    os.mkfifo(fifo)
    line = refused(capsys, "generate", "-p", "hi", "--prompt-cache", str(fifo))
    assert "is not a regular file" in line


@pytest.mark.parametrize(
    "setup, words",
    [
        ("read-only", "is read-only; make it writable (chmod u+w) or name another file"),
        ("missing folder", "does not exist; create it first"),
        ("full disk", "cannot write it (No space left on device)"),
    ],
)
def test_unwritable_destination_is_one_line(saved, default_model, tmp_path, monkeypatch, setup,
                                            words):  # fmt: skip
    gen = Session(default_model, KVPolicy())
    for _ in gen.run("hi", GenerationSettings(max_tokens=2)):
        pass
    path = tmp_path / "c.safetensors"
    if setup == "read-only":
        path.write_bytes(b"user data")
        path.chmod(0o444)
    elif setup == "missing folder":
        path = tmp_path / "nope" / "c.safetensors"
    else:
        real = os.fsync

        def full(fd):
            if stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(28, "No space left on device")
            return real(fd)

        monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(UserError) as e:
        gen.save_cache(path)
    assert words in str(e.value) and "\n" not in str(e.value)
    if setup == "read-only":
        assert path.read_bytes() == b"user data"
        assert stat.S_IMODE(path.stat().st_mode) == 0o444
    assert sorted(p.name for p in tmp_path.iterdir()) == (
        ["c.safetensors"] if setup == "read-only" else []
    )


def test_save_keeps_the_files_mode_and_follows_no_planted_link(default_model, tmp_path):
    gen = Session(default_model, KVPolicy())
    for _ in gen.run("hi", GenerationSettings(max_tokens=2)):
        pass
    path = tmp_path / "c.safetensors"
    gen.save_cache(path)
    path.chmod(0o600)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    (tmp_path / f".c.safetensors.{os.getpid()}.tmp.safetensors").symlink_to(victim)
    gen.save_cache(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert victim.read_bytes() == b"precious"


def test_tensors_that_share_bytes_are_refused_before_mlx(saved, default_model, tmp_path):
    """A small file whose header names its data many times loaded as gigabytes (300
    extra entries over an 11.8 MB file took 3.4 GB) before its digest refused it."""
    import json
    import struct

    src, _ = saved["full"]
    raw = src.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    for i in range(3):
        header[f"0.z{i}"] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]}
    text = json.dumps(header).encode()
    path = tmp_path / "shared.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    before = path.read_bytes()
    gen = Session(default_model, KVPolicy())
    with pytest.raises(CacheError) as e:
        gen.load_cache(path)
    assert (
        str(e.value)
        == "shared.safetensors is not a readable cache file (two tensors share bytes); delete it"
    )
    assert gen.tokens == [] and path.read_bytes() == before
