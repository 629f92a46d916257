"""``mlxkv plan`` run in process by the plan test modules."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mlxkv.commands import plan

CONFIGS = Path(__file__).parent / "data" / "configs"
LLAMA31 = str(CONFIGS / "mac" / "llama-3.1-8b-instruct.json")
LLAMA31_4BIT = str(CONFIGS / "mac" / "llama-3.1-8b-instruct-4bit.json")


def run_plan(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="mlxkv plan")
    plan.add_arguments(parser)
    return plan.run(parser.parse_args(list(argv)))


def plan_json(capsys, *argv: str) -> tuple[int, dict]:
    """The exit code and the JSON of ``mlxkv plan ARGV --json``."""
    code = run_plan(*argv, "--json")
    return code, json.loads(capsys.readouterr().out)
