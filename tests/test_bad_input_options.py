"""An option a command does not have: one line naming it and the command's nearest option
(the spellings users bring from mlx-lm, OpenAI's API and other tools), exit 2, nothing run."""

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
            "mlxkv plan: error: unknown option --frobnicate; mlxkv plan --help lists the options",
        ),
        (["plan", "a", "b"], "mlxkv plan: error: unexpected argument 'b'; see mlxkv plan --help"),
    ],
)
def test_an_unknown_option_names_the_nearest_one(capsys, argv, line):
    assert main(argv) == 2
    got = capsys.readouterr()
    assert (got.err, got.out) == (line + "\n", "")
