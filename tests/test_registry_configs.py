"""Registry aliases plan offline: their config.json files ship with mlxkv, and a hub whose
host name does not resolve is asked once, never retried."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

from mlxkv.errors import UserError
from mlxkv.models import registry
from mlxkv.models import resolve as r
from tests.conftest import run_cli

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
ALIASES = list(tomllib.loads((ROOT / "models.toml").read_text())["models"])
# ".invalid" never resolves (RFC 2606): a hub that cannot be reached at all
NO_HUB = {
    "HF_ENDPOINT": "https://hub.invalid",
    "HF_HUB_OFFLINE": "0",
    **{proxy: "" for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY")},
}


@pytest.fixture
def own_registry(tmp_path, monkeypatch):
    """The shipped models.toml, empty mlxkv and Hugging Face caches."""
    monkeypatch.delenv("MLXKV_MODELS", raising=False)
    monkeypatch.setenv("MLXKV_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    registry.load_registry.cache_clear()
    yield
    registry.load_registry.cache_clear()
    r._hub_checked.clear()


@pytest.fixture
def dns_fails(monkeypatch):
    """Every host name lookup fails, as on a machine with no network; returns the lookups."""
    import huggingface_hub.constants

    asked = []

    def fail(host, *args, **kwargs):
        asked.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fail)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
    r._hub_checked.clear()
    yield asked
    r._hub_checked.clear()


def test_every_registry_model_ships_its_config(own_registry):
    reg = registry.load_registry()
    assert sorted(reg.models) == sorted(ALIASES) and ALIASES
    for alias, entry in reg.models.items():
        path = registry.shipped_config(entry.hf_repo)
        assert path is not None, f"{alias}: no mlxkv/model_configs file for {entry.hf_repo}"
        cfg = json.loads(path.read_text())
        assert cfg["model_type"] and cfg["num_hidden_layers"] > 0, alias
        if entry.hf_repo.endswith("-4bit") or "-4bit-" in entry.hf_repo:
            assert cfg["quantization"] == {"group_size": 64, "bits": 4}, alias
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "model_configs/*.json" in pyproject["tool"]["setuptools"]["package-data"]["mlxkv"]


@pytest.mark.parametrize("name", ["../../etc/passwd", "a/b/c", "plain"])
def test_shipped_config_is_only_looked_up_by_repo_id(name):
    assert registry.shipped_config(name) is None


@pytest.mark.parametrize("alias", ALIASES)
def test_an_alias_resolves_offline_with_one_lookup(own_registry, dns_fails, alias):
    src = r.resolve_config(alias)
    entry = registry.lookup(alias)
    assert src.config == json.loads(registry.shipped_config(entry.hf_repo).read_text())
    assert src.repo is None  # no safetensors metadata asked of a hub that is not there
    assert "shipped config" in src.how
    assert len(dns_fails) <= 1  # one lookup of the hub's name, no retries


def test_an_unresolvable_hub_fails_at_once_for_a_repo_id(own_registry, dns_fails):
    with pytest.raises(UserError, match="hub is unreachable .*cannot be resolved"):
        r.resolve_config("nobody-here/no-such-model")
    with pytest.raises(UserError, match="unreachable"):
        r.resolve("nobody-here/no-such-model")
    assert len(dns_fails) == 1  # asked once, the answer reused


def test_plan_of_an_alias_through_the_cli_without_a_hub(tmp_path):
    env = {**NO_HUB, "MLXKV_HOME": str(tmp_path / "home"), "HF_HOME": str(tmp_path / "hf")}
    out = run_cli("plan", "llama3.1-8b", "--context", "32768", "--kv-bits", "4", env=env)
    assert out.returncode in (0, 1), out.stderr  # fits or not, on this machine
    first = out.stdout.splitlines()[0]
    assert first.startswith("llama3.1-8b: model_type llama")
    assert "alias (mlx-community/Meta-Llama-3.1-8B-Instruct-4bit, shipped config)" in first
    assert "Retry" not in out.stderr and "Traceback" not in out.stderr


def test_plan_of_an_unknown_repo_without_a_hub_is_one_line(tmp_path):
    env = {**NO_HUB, "MLXKV_HOME": str(tmp_path / "home"), "HF_HOME": str(tmp_path / "hf")}
    out = run_cli("plan", "nobody-here/no-such-model", env=env)
    assert out.returncode == 2
    assert out.stderr == (
        "mlxkv plan: error: could not fetch config.json of 'nobody-here/no-such-model': the "
        "Hugging Face hub is unreachable (hub.invalid cannot be resolved); pass a local "
        "config.json or model folder\n"
    )
