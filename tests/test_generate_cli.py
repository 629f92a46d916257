"""``mlxkv generate`` end to end on the default model, and its bad-input answers."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from tests.json_schemas import CITY


@pytest.mark.model
def test_capital_of_france_json(default_model_path):
    out = run_cli(
        "generate", "--prompt", "What is the capital of France?",
        "--max-tokens", "30", "--temp", "0", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert "Paris" in result["text"]
    for key in ("finish_reason", "prompt_tokens", "generation_tokens", "prompt_tps",
                "generation_tps", "peak_memory_bytes"):  # fmt: skip
        assert key in result
    assert result["finish_reason"] == "stop"
    assert result["kv_bytes_actual"] == result["kv_bytes_predicted"]
    assert result["kv_tokens"] == result["prompt_tokens"] + result["generation_tokens"]


@pytest.mark.model
def test_streams_text_from_stdin_prompt(cli, preloaded):
    out = cli(
        "generate", "--prompt", "-", "--max-tokens", "12", "--raw", stdin="The capital of France is"
    )
    assert out.returncode == 0, out.stderr
    # the continuation's own first space: "The capital of France is" + " Paris"
    assert out.stdout.startswith(" Paris")
    assert "tok/s" in out.stderr


@pytest.mark.model
def test_json_schema_holds_the_answer(cli, preloaded, tmp_path):
    """--json-schema FILE: the answer is JSON matching the schema (the engine's tokens are
    checked against llguidance's reference in tests/test_grammar.py); the file is only
    read."""
    path = tmp_path / "city.json"
    path.write_text(json.dumps(CITY))
    before = path.read_bytes()
    ask = ["generate", "-p", "What is the capital of France?", "--max-tokens", "40", "--json"]
    out = cli(*ask, "--json-schema", str(path))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["finish_reason"] == "stop"
    answer = json.loads(result["text"])
    assert set(answer) == {"city", "country"} and answer["country"] == "France"
    assert json.loads(cli(*ask).stdout)["text"] != result["text"]
    assert path.read_bytes() == before


@pytest.mark.model
def test_ignore_eos_gives_an_answer_of_max_tokens(cli, preloaded):
    """--ignore-eos runs the answer to --max-tokens (a set length, to measure speed);
    --min-tokens keeps it going past its EOS; the plain answer ends at its ninth token."""
    ask = ["generate", "-p", "Reply with one word: is the sky blue?", "--json"]
    plain = json.loads(cli(*ask, "--max-tokens", "16").stdout)
    assert (plain["finish_reason"], plain["generation_tokens"]) == ("stop", 9)
    long = json.loads(cli(*ask, "--max-tokens", "16", "--ignore-eos").stdout)
    assert (long["finish_reason"], long["generation_tokens"]) == ("length", 16)
    assert long["text"].startswith(plain["text"])
    more = json.loads(cli(*ask, "--max-tokens", "16", "--min-tokens", "12").stdout)
    assert more["generation_tokens"] > 12


@pytest.mark.slow  # bytes under sinks + window are checked per event in test_engine.py
@pytest.mark.model
def test_sink_window_keeps_at_most_window_plus_sinks(default_model_path):
    out = run_cli(
        "generate", "--prompt", "Write a long story about a lighthouse keeper.",
        "--kv-window", "96", "--kv-sinks", "4", "--max-tokens", "150", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["kv_tokens"] <= 100
    assert r["kv_evicted"] == r["prompt_tokens"] + r["generation_tokens"] - r["kv_tokens"]
    assert r["kv_bytes_actual"] == r["kv_bytes_predicted"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", "   "], "the prompt is empty"),
        (
            ["--prompt", "hi", "--kv-window", "4", "--kv-sinks", "4"],
            "must be larger than --kv-sinks",
        ),
        (["--prompt", "hi", "--kv-bits", "7"], "--kv-bits 7 is not supported"),
        (
            ["--prompt", "hi", "--kv-bits", "4", "--kv-group-size", "48"],
            "--kv-group-size 48 is not supported",
        ),
        (["--prompt", "hi", "--kv-sinks", "4"], "--kv-sinks needs a window"),
        (["--prompt", "hi", "--max-tokens", "0"], "--max-tokens must be at least 1"),
        (["--prompt", "hi", "--min-tokens", "-1"], "--min-tokens must be at least 0, got -1"),
        (
            ["--prompt", "hi", "--ignore-eos", "--json-schema", "x.json"],
            "--ignore-eos cannot go with --json-schema: the answer ends where its schema does",
        ),
        (["--prompt", "hi", "--model", "no-such-model"], "unknown model 'no-such-model'"),
    ],
)
def test_bad_input_one_line_exit_2(args, message):
    out = run_cli("generate", *args, env={"HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    assert "Traceback" not in out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("mlxkv generate: error:")]
    assert len(lines) == 1 and message in lines[0], out.stderr


def test_kv_bits_refused_before_generating_on_a_model_that_cannot_take_them(
    cli, tmp_path, default_model_path
):
    """A tiny random gemma2 folder (its attention cannot read quantized keys) with the
    default model's tokenizer: refused up front, one line, exit 2."""
    from tests.tiny_models import FAMILIES, model_folder

    model_folder(tmp_path, dict(FAMILIES["gemma2"], vocab_size=49152), default_model_path)

    out = cli(
        "generate",
        "--model",
        str(tmp_path),
        "--prompt",
        "hi",
        "--kv-bits",
        "4",
        "--kv-group-size",
        "32",
    )
    assert out.returncode == 2, out.stderr
    assert out.stdout == "" and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("mlxkv generate: error: gemma2: ")
    assert out.stderr.strip().endswith("drop --kv-bits")

    args = ["--model", str(tmp_path), "--prompt", "hi", "--max-tokens", "3", "--kv-window", "32"]
    ok = cli("generate", *args, "--json")
    assert ok.returncode == 0, ok.stderr


@pytest.mark.model
@pytest.mark.slow
def test_drafts_leave_the_answer_and_json_counts_them(cli, preloaded):
    """A greedy answer copying its prompt: with the default --draft-tokens most of it came
    as drafts (--json says how many); with 0 none did, and the text is the same."""
    from tests.test_lookup import COPY

    ask = ["generate", "-p", COPY, "--max-tokens", "30", "--json"]
    runs = [cli(*ask), cli(*ask, "--draft-tokens", "0")]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr
    drafted, plain = (json.loads(r.stdout) for r in runs)
    assert drafted["text"] == plain["text"] and drafted["generation_tokens"] == 30
    assert 15 <= drafted["draft_tokens_accepted"] <= drafted["draft_tokens"]
    assert (plain["draft_tokens"], plain["draft_tokens_accepted"]) == (0, 0)
    assert drafted["kv_tokens"] == plain["kv_tokens"] == plain["prompt_tokens"] + 30
