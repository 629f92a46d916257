"""``mlxkv plan`` with bad input: one line, no traceback, the config file untouched."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bad_input import refused

LLAMA = Path(__file__).parent / "data" / "configs" / "published" / "llama-2-7b.json"


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXKV_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLXKV_DEVICE", "cpu")


@pytest.mark.parametrize(
    "change, words",
    [
        ('"rope_theta": NaN', "'rope_theta' is not a finite number"),
        ('"rope_theta": -10000.0', "'rope_theta' must be positive"),
        ('"rms_norm_eps": Infinity', "'rms_norm_eps' is not a finite number"),
        ('"rope_scaling": {"factor": NaN}', "'rope_scaling.factor' is not a finite number"),
        ('"hidden_size": -4096', "'hidden_size' must be positive"),
    ],
)
def test_non_finite_or_negative_config_numbers(capsys, tmp_path, change, words):
    cfg = tmp_path / "config.json"
    text = json.dumps(json.loads(LLAMA.read_text()))[:-1] + ", " + change + "}"
    cfg.write_text(text)
    assert words in refused(capsys, "plan", str(cfg))
    assert cfg.read_text() == text


def test_output_to_a_full_disk_is_one_line():
    for extra in ([], ["--json"]):
        with open("/dev/full", "w") as full:
            p = subprocess.run(
                [sys.executable, "-m", "mlxkv", "plan", str(LLAMA), *extra],
                stdout=full,
                stderr=subprocess.PIPE,
                text=True,
            )
        assert p.returncode == 1
        assert (
            p.stderr.strip()
            == "mlxkv plan: error: cannot write the output: No space left on device"
        )


def test_home_that_is_a_file(capsys, monkeypatch, tmp_path):
    home = tmp_path / "afile"
    home.write_text("x")
    monkeypatch.setenv("MLXKV_HOME", str(home))
    assert "MLXKV_HOME=" in refused(capsys, "plan", "smollm2-135m")
    assert home.read_text() == "x"


@pytest.mark.parametrize("kind", ["/dev/zero", "fifo", "deep", "big"])
def test_config_that_never_ends_or_nests_deeply(capsys, tmp_path, kind):
    import os

    path = tmp_path / "config.json"
    if kind == "/dev/zero":
        path = Path("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "deep":
        path.write_text('{"a": ' + "[" * 100000 + "]" * 100000 + "}")
    else:
        with open(path, "wb") as f:
            f.truncate(17 << 20)  # sparse
    line = refused(capsys, "plan", str(path))
    words = {
        "deep": "nests arrays/objects deeper than 64 levels",
        "big": "is 17 MiB, more than the 16 MiB allowed",
    }.get(kind, "is not a regular file")
    assert words in line
