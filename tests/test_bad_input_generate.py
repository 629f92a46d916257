"""``mlxkv generate`` with bad input: exit 2, one line, no traceback, files untouched."""

from __future__ import annotations

import io

import pytest

from mlxkv.models.registry import load_registry
from tests.bad_input import refused, snapshot, truncated_copy


@pytest.fixture(autouse=True)
def _no_model(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded")

    # Imported first: importing it while loader.load is patched would bind its ``load`` to
    # ``refuse`` for good, and the other test files on this worker could load no model.
    import mlxkv.engine.loading  # noqa: F401

    monkeypatch.setattr("mlxkv.models.loader.load", refuse)
    monkeypatch.setattr("mlxkv.engine.loading.load", refuse)


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--repetition-penalty", "-1"], "--repetition-penalty must be above 0"),
        (["--seed", "-1"], "--seed must be in [0,"),
        (["--seed", str(2**70)], "--seed must be in [0,"),
        (["--temp", "nan"], "--temp must be at least 0, got nan"),
        (["--temp", "inf"], "--temp must be at least 0, got inf"),
        (["--top-k", "-1"], "--top-k must be at least 0"),
        (["--min-p", "5"], "--min-p must be in [0, 1]"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--max-tokens", "0"], "--max-tokens must be at least 1"),
        (["--prefill-step", "0"], "--prefill-step must be at least 1"),
        (["--thinking-budget", "-1"], "--thinking-budget must be at least 0, got -1"),
        (["--kv-window", "-3"], "--kv-window"),
        (["--kv-window", "9" * 23], "is past any model's context; use at most 1073741824"),
        (["--kv-sinks", "9" * 23, "--kv-window", "64"], "--kv-sinks 99999999999999999999999"),
        (["--kv-bits", "7"], "--kv-bits"),
    ],
)
def test_bad_flags(capsys, flags, words):
    assert words in refused(capsys, "generate", "-p", "hi", *flags)


@pytest.mark.parametrize("value", ["-1", "65", "x", "2.5"])
def test_a_bad_draft_count_is_one_line(capsys, value):
    from mlxkv.cli import main

    with pytest.raises(SystemExit) as e:  # argparse's own refusal, as the terminal sees it
        main(["generate", "-p", "hi", "--draft-tokens", value])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "mlxkv generate: error: argument --draft-tokens: expected a whole number from 0 (off) "
        f"to 64, got '{value}'; see 'mlxkv generate --help'\n"
    )


@pytest.mark.parametrize(
    "content, words",
    [
        (None, "--json-schema {path} does not exist"),
        (b'{"type": ', "--json-schema {path} is not valid JSON"),
        (b'["object"]', "--json-schema {path} must hold a JSON object (a JSON Schema)"),
        (b'{"type": "nonsense"}', "--json-schema {path}: the JSON schema cannot be used: "
                                  "Invalid type: nonsense"),
        (b"\xff{}", "--json-schema {path} is not UTF-8 text (byte 0)"),
        (b"[" * 100 + b"]" * 100, "--json-schema {path} nests arrays/objects deeper than 64"),
        (b" " * (1 << 20) + b"{}", "--json-schema {path} is 1,048,578 bytes, more than the "
                                   "1,048,576 bytes allowed"),
    ],
)  # fmt: skip
def test_a_json_schema_file_that_cannot_be_used(capsys, tmp_path, content, words):
    """Refused in one line before the model loads; the file is left as it was."""
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_bytes(content)
    for command in ("generate", "batch"):
        args = ["-p", "hi"] if command == "generate" else [str(path), "-o", str(tmp_path / "o")]
        line = refused(capsys, command, *args, "--json-schema", str(path))
        assert words.format(path=path) in line, line
        assert path.read_bytes() == content if content is not None else not path.exists()
    assert not (tmp_path / "o").exists()


def test_closed_stdin(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", None)
    assert "stdin is closed" in refused(capsys, "generate", "-p", "-")


def test_non_utf8_prompt(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9")))
    assert "not UTF-8 text (byte 3)" in refused(capsys, "generate", "-p", "-")


@pytest.fixture
def fresh_registry():
    load_registry.cache_clear()
    yield
    load_registry.cache_clear()


@pytest.mark.parametrize("kind", ["missing", "directory", "binary"])
def test_bad_models_registry_is_named(capsys, monkeypatch, tmp_path, fresh_registry, kind):
    target = {"missing": tmp_path / "nope.toml", "directory": tmp_path}.get(kind)
    if kind == "binary":
        target = tmp_path / "bin.toml"
        target.write_bytes(b"\x7fELF\x02\x01\x01\xff\xfe")
    monkeypatch.setenv("MLXKV_MODELS", str(target))
    before = snapshot(tmp_path)
    assert "MLXKV_MODELS=" in refused(capsys, "generate", "-p", "hi")
    assert snapshot(tmp_path) == before


def test_home_that_is_a_file(capsys, monkeypatch, tmp_path):
    home = tmp_path / "home"
    home.write_text("mine")
    monkeypatch.setenv("MLXKV_HOME", str(home))
    assert "MLXKV_HOME=" in refused(capsys, "generate", "-p", "hi", "-m", "smollm2-135m")
    assert home.read_text() == "mine"


def test_truncated_weights(capsys, tmp_path, default_model_path):
    """An interrupted download: the file is shorter than its header says."""
    folder = truncated_copy(default_model_path, tmp_path / "model")
    before = snapshot(folder)
    err = refused(capsys, "generate", "-p", "hi", "-m", str(folder))
    assert "truncated" in err and "download" in err
    assert snapshot(folder) == before
    (folder / "model.safetensors").write_bytes(b"\x01")
    assert "not a complete safetensors file" in refused(capsys, "plan", str(folder))


@pytest.mark.parametrize(
    "content, words",
    [
        ("[" * 100000 + "]" * 100000, "--messages {p} nests arrays/objects deeper than 64 levels"),
        ('[{"role": "user", "content": "a\\ud800b"}]', "holds '\\ud800', a lone surrogate"),
        ("[{", "--messages {p} is not valid JSON (line 1, column 3"),
    ],
)
def test_messages_file_deep_or_with_lone_surrogates(capsys, tmp_path, content, words):
    p = tmp_path / "conv.json"
    p.write_text(content)
    line = refused(capsys, "generate", "--messages", str(p))
    assert words.format(p=p) in line
    assert p.read_text() == content


@pytest.mark.parametrize("kind", ["/dev/zero", "fifo", "big"])
def test_messages_file_that_never_ends(capsys, tmp_path, kind):
    import os

    path = kind
    if kind == "fifo":
        path = tmp_path / "fifo"
        os.mkfifo(path)
    elif kind == "big":
        path = tmp_path / "big.json"
        with open(path, "wb") as f:
            f.truncate(65 << 20)  # sparse: costs no disk
    line = refused(capsys, "generate", "--messages", str(path))
    assert ("is not a regular file" if kind != "big" else "more than the 64 MiB allowed") in line


def test_lone_surrogates_in_prompt_and_system(capsys):
    # argv decodes undecodable bytes to lone surrogates (surrogateescape)
    assert "--prompt is not UTF-8 text (the byte 0xff); write it in UTF-8" in refused(
        capsys, "generate", "-p", "caf\udcff"
    )
    assert "--system is not UTF-8 text ('\\ud800')" in refused(
        capsys, "generate", "-p", "hi", "--system", "\ud800"
    )


def test_messages_past_the_bound_are_refused_before_the_model_loads(capsys, tmp_path):
    """100,000 short messages are over a million tokens for the model to read, window or not:
    refused at once (10,000 pass the check; the model is never loaded here)."""
    import json

    p = tmp_path / "conv.json"
    turns = [{"role": ("user", "assistant")[i % 2], "content": f"m{i}"} for i in range(100_001)]
    p.write_text(json.dumps(turns))
    before = p.read_bytes()
    line = refused(capsys, "generate", "--messages", str(p), "--kv-window", "256")
    assert line == (
        f"mlxkv generate: error: --messages {p} holds 100,001 messages; mlxkv answers "
        "conversations of up to 10,000: keep the last ones (every message is read again, "
        "token by token, even under --kv-window)"
    )
    assert p.read_bytes() == before
    p.write_text(json.dumps(turns[:10_000]))
    with pytest.raises(AssertionError, match="the model was loaded"):
        refused(capsys, "generate", "--messages", str(p), "--kv-window", "256")


@pytest.mark.model
@pytest.mark.parametrize("source", ["--messages", "--prompt"])
def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_read(
    capsys, tmp_path, preloaded, default_model, monkeypatch, source
):
    """4 MB cannot fit an 8192-token context: refused by its characters, before the chat
    template copies it or the tokenizer reads it (20 MB took 5.4 GB and 34 s before)."""
    import json

    tok = type(default_model.tokenizer._tokenizer)
    seen = []
    real = tok.encode
    monkeypatch.setattr(
        tok, "encode", lambda s, text, *a, **k: seen.append(len(text)) or real(s, text, *a, **k)
    )
    text = "x " * 2_000_000
    if source == "--messages":
        p = tmp_path / "conv.json"
        p.write_text(json.dumps([{"role": "user", "content": text}]))
        argv = ["--messages", str(p)]
    else:
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
        argv = ["--prompt", "-"]
    line = refused(capsys, "generate", *argv, "--max-tokens", "2")
    assert line == (
        "mlxkv generate: error: the prompt is 4000000 characters, more than the model's "
        "context of 8192 tokens can hold; shorten it (or clear the chat), use a window "
        "(--kv-window) or --on-overflow slide"
    )
    assert max(seen, default=0) < 1000
