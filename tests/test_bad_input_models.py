"""``mlxkv models`` and ``mlxkv pull`` with a bad environment: the variable is named."""

from __future__ import annotations

import pytest

from mlxkv.models.registry import load_registry
from tests.bad_input import refused


@pytest.fixture(autouse=True)
def fresh_registry():
    load_registry.cache_clear()
    yield
    load_registry.cache_clear()


@pytest.mark.parametrize("command", [["models"], ["pull"]])
@pytest.mark.parametrize("kind", ["missing", "directory", "binary", "not toml"])
def test_bad_registry_file(capsys, monkeypatch, tmp_path, command, kind):
    target = tmp_path / "models.toml"
    if kind == "directory":
        target = tmp_path
    elif kind == "binary":
        target.write_bytes(b"\x00\xff\xfe")
    elif kind == "not toml":
        target.write_text("this is [not toml")
    monkeypatch.setenv("MLXKV_MODELS", str(target))
    assert "MLXKV_MODELS=" in refused(capsys, *command)


def test_pull_with_home_a_file(capsys, monkeypatch, tmp_path):
    home = tmp_path / "f"
    home.write_text("x")
    monkeypatch.setenv("MLXKV_HOME", str(home))
    assert "MLXKV_HOME=" in refused(capsys, "pull")
    assert home.read_text() == "x"
