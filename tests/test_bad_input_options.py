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
            ["serve", "--sinks", "4"],
            "mlxkv serve: error: unknown option --sinks; did you mean --kv-sinks?",
        ),
        (
            ["plan", "llama-3.1-8b", "--frobnicate"],
            "mlxkv plan: error: unknown option --frobnicate; see 'mlxkv plan --help'",
        ),
        (["plan", "a", "b"], "mlxkv plan: error: unexpected argument 'b'; see 'mlxkv plan --help'"),
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
