"""The command line refused in one line, exit 2, nothing run: an option a command does not
have names the command's nearest option (the spellings users bring from mlx-lm, OpenAI's API
and other tools); a value argparse refuses gets its message without the usage block."""

from __future__ import annotations

import pytest

from mlxkv.cli import main


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["generate", "--window", "8", "--prompt", "hi"],
            "mlxkv generate: error: unknown option --window; did you mean --kv-window?",
        ),
        (
            ["generate", "--temperature", "0.5", "--prompt", "hi"],
            "mlxkv generate: error: unknown option --temperature; did you mean --temp?",
        ),
        (
            ["generate", "--max_tokens=5", "--prompt", "hi"],
            "mlxkv generate: error: unknown option --max_tokens; did you mean --max-tokens?",
        ),
        # the value after an unknown option is taken as MODEL: the option is still what's wrong
        (
            ["generate", "--sink", "4", "--prompt", "hi"],
            "mlxkv generate: error: unknown option --sink; did you mean --kv-sinks?",
        ),
        (
            ["generate", "--repeat-penalty", "1.1", "--prompt", "hi"],
            "mlxkv generate: error: unknown option --repeat-penalty; did you mean "
            "--repetition-penalty?",
        ),
        (
            ["serve", "--sinks", "4"],
            "mlxkv serve: error: unknown option --sinks; did you mean --kv-sinks?",
        ),
        # no near option: the help, not an unrelated one (the dashes alone made these alike)
        (
            ["chat", "--nonsense"],
            "mlxkv chat: error: unknown option --nonsense; see 'mlxkv chat --help'",
        ),
        (
            ["generate", "--host", "::1", "--prompt", "hi"],
            "mlxkv generate: error: unknown option --host; see 'mlxkv generate --help'",
        ),
        (
            ["serve", "--json"],
            "mlxkv serve: error: unknown option --json; see 'mlxkv serve --help'",
        ),
        (
            ["batch", "in.jsonl", "-o", "out.jsonl", "--frobnicate"],
            "mlxkv batch: error: unknown option --frobnicate; see 'mlxkv batch --help'",
        ),
        (
            ["plan", "llama-3.1-8b", "--frobnicate"],
            "mlxkv plan: error: unknown option --frobnicate; see 'mlxkv plan --help'",
        ),
        (["plan", "a", "b"], "mlxkv plan: error: unexpected argument 'b'; see 'mlxkv plan --help'"),
        # a prompt given the way other tools take it, or words of it left unquoted
        (
            ["generate", "Why is the sky blue?"],
            "mlxkv generate: error: unexpected argument 'Why is the sky blue?'; give the prompt "
            "as --prompt 'TEXT' (quoted)",
        ),
        (
            ["generate", "-p", "Why", "is", "the", "sky", "blue?"],
            "mlxkv generate: error: unexpected argument 'is'; give the prompt as --prompt 'TEXT' "
            "(quoted)",
        ),
    ],
)
def test_an_unknown_option_names_the_nearest_one(capsys, argv, line):
    assert main(argv) == 2
    got = capsys.readouterr()
    assert (got.err, got.out) == (line + "\n", "")


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["generate", "--max-tokens", "lots"],
            "mlxkv generate: error: argument --max-tokens: invalid int value: 'lots'; "
            "see 'mlxkv generate --help'",
        ),
        (
            ["plan"],
            "mlxkv plan: error: the following arguments are required: MODEL; "
            "see 'mlxkv plan --help'",
        ),
        (
            ["chta"],
            "mlxkv: error: argument COMMAND: invalid choice: 'chta' (choose from 'chat', 'top', "
            "'plan', 'generate', 'batch', 'serve', 'models', 'pull', 'bench'); see 'mlxkv --help'",
        ),
    ],
)
def test_a_value_argparse_refuses_is_one_line_without_the_usage(capsys, argv, line):
    with pytest.raises(SystemExit) as e:
        main(argv)
    got = capsys.readouterr()
    assert (e.value.code, got.err, got.out) == (2, line + "\n", "")


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["generate", "--prompt", "caf\udce9"],  # b"caf\xe9" in a Latin-1 terminal
            "mlxkv generate: error: --prompt is not UTF-8 text (the byte 0xe9); write it in UTF-8",
        ),
        (
            ["batch", "in.jsonl", "-o", "out.jsonl", "--stop", "a\udcfe"],
            "mlxkv batch: error: --stop is not UTF-8 text (the byte 0xfe); write it in UTF-8",
        ),
        (
            ["plan", "\udce9t\udce9"],
            "mlxkv plan: error: MODEL is not UTF-8 text (the byte 0xe9); write it in UTF-8",
        ),
    ],
)
def test_an_argument_that_is_not_utf8_is_named(capsys, argv, line):
    """Python keeps undecodable argv bytes as lone surrogates, which no tokenizer or JSON
    takes: refused by name before anything runs."""
    assert main(argv) == 2
    got = capsys.readouterr()
    assert (got.err, got.out) == (line + "\n", "")


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "a" * 300],
        ["plan", "a" * 300 + ".json"],
        ["batch", "in.jsonl", "-o", "a" * 300],
        ["generate", "--prompt", "hi", "--prompt-cache", "a" * 300 + ".safetensors"],
    ],
)
def test_a_file_name_past_the_system_limit_is_one_line(capsys, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    assert main(argv) == 2
    got = capsys.readouterr()
    shown = f"'{'a' * 40}...{('a' * 300 + argv[-1][300:])[-20:]}'"
    assert got.err == (
        f"mlxkv {argv[0]}: error: the file name {shown} is too long for this system; "
        "use a shorter one\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["plan", "smollm2-135m", "--shard", "banana"],
            "mlxkv plan: error: --shard splits a model over --hosts N; add --hosts",
        ),
        (
            ["generate", "--prompt", "hi", "--raw", "--system", "be brief"],
            "mlxkv generate: error: --system goes into the chat template, which --raw skips; "
            "drop one",
        ),
        (
            ["batch", "in.jsonl", "-o", "-"],
            "mlxkv batch: error: -o - would be a file named '-': records go to a file, which a "
            "rerun resumes; name one (e.g. -o out.jsonl)",
        ),
        *[
            (
                argv,
                f"mlxkv {argv[0]}: error: the model name is empty; name a model folder, alias "
                "or repo id",
            )
            for argv in (["plan", ""], ["pull", ""], ["generate", "-p", "hi", "--model", " "])
        ],
    ],
)
def test_flags_that_would_be_ignored_or_misread_are_refused(
    capsys, tmp_path, monkeypatch, argv, line
):
    """An empty MODEL was the current folder (plan) or the default model (pull); --shard
    without --hosts, --system with --raw and -o - did nothing the user asked for."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    assert main(argv) == 2
    got = capsys.readouterr()
    assert (got.err, got.out) == (line + "\n", "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
