"""``mlxkv plan`` with bad input: one line, no traceback, the config file untouched."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bad_input import refused
from tests.plan_cli import plan_json

LLAMA = Path(__file__).parent / "data" / "configs" / "published" / "llama-2-7b.json"


pytestmark = pytest.mark.usefixtures("fresh_home", "cpu_device")


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


PUBLISHED = LLAMA.parent


def plan_out(*argv: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """``mlxkv plan ARGV`` in a subprocess (a hang fails the test at ``timeout``)."""
    return subprocess.run(
        [sys.executable, "-m", "mlxkv", "plan", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("memory", ["16GB,", ",", "16GB,,8GB", ",16GB"])
def test_memory_with_an_empty_size_says_so(capsys, memory):
    err = refused(capsys, "plan", str(LLAMA), "--hosts", "2", "--memory", memory)
    assert err == (
        f"mlxkv plan: error: --memory '{memory}' has an empty size between or after its "
        "commas; give one size for every host (--memory 64GB) or one per host "
        "(--memory 64GB,32GB)"
    )


def test_memory_with_too_many_sizes_counts_them(capsys):
    err = refused(capsys, "plan", str(LLAMA), "--hosts", "1", "--memory", "8GB,8GB")
    assert "--memory lists 2 sizes for 1 host;" in err


@pytest.mark.parametrize(
    "flags, named",
    [(["--fit"], "--fit plans"), (["--chart"], "--chart plans"),
     (["--fit", "--chart", "x.png"], "--fit and --chart plan")],
)  # fmt: skip
def test_fit_and_chart_are_refused_with_hosts(capsys, tmp_path, monkeypatch, flags, named):
    monkeypatch.chdir(tmp_path)
    err = refused(capsys, "plan", str(LLAMA), "--hosts", "2", *flags)
    assert err.startswith(f"mlxkv plan: error: {named} one host and cannot be used with --hosts")
    assert list(tmp_path.iterdir()) == []  # no chart written


def test_hosts_notes_speak_of_each_host_not_of_one(capsys):
    """DeepSeek-V3 over 8 hosts of 1 TB: each holds about 322 GiB of weights and fits; the
    whole-model note "the weights alone exceed" would be about one host and is not shown."""
    deepseek = str(PUBLISHED / "deepseek-v3.json")
    code, d = plan_json(capsys, deepseek, "--hosts", "8", "--memory", "1TB")
    assert code == 0 and d["fits"]
    assert all(h["weights_bytes"] < h["available_bytes"] for h in d["per_host"])
    assert d["notes"] == []
    assert d["single_host"]["weights_bytes"] > d["per_host"][0]["available_bytes"]
    code, d = plan_json(capsys, deepseek, "--hosts", "2", "--memory", "1TB")
    assert code == 1
    assert d["notes"] == [
        f"host {r}: its weights alone exceed its available memory" for r in (0, 1)
    ]


def test_fit_proposes_a_pipeline_where_tensor_splits_do_not_fit(capsys):
    """qwen2.5-7b (28 layers, 4 KV heads) on 8 GB hosts: 2 or 4 tensor-parallel hosts are
    too small (embeddings and head are whole on each), a pipeline of enough hosts is not."""
    qwen = str(PUBLISHED / "qwen2.5-7b-instruct.json")
    code, d = plan_json(capsys, qwen, "--memory", "8GB", "--fit")
    assert code == 1
    hosts = [s["flags"] for s in d["suggestions"] if "--hosts" in s["flags"]]
    assert [f[2:] for f in hosts] == [["--shard", "pipeline"]]
    n = int(hosts[0][1])
    pipeline = ["--memory", "8GB", "--shard", "pipeline"]
    assert plan_json(capsys, qwen, *pipeline, "--hosts", str(n))[0] == 0
    assert plan_json(capsys, qwen, *pipeline, "--hosts", str(n - 1))[0] == 1
    assert plan_json(capsys, qwen, "--memory", "8GB", "--hosts", "4")[1]["shard"] == "tensor"
    assert plan_json(capsys, qwen, "--memory", "8GB", "--hosts", "4")[0] == 1


@pytest.mark.parametrize("layers", [1025, 10**6, 10**9])
def test_a_config_with_absurdly_many_layers_is_refused_at_once(tmp_path, layers):
    cfg = tmp_path / "config.json"
    text = json.dumps({**json.loads(LLAMA.read_text()), "num_hidden_layers": layers})
    cfg.write_text(text)
    out = plan_out(str(cfg), timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (
        f"mlxkv plan: error: 'num_hidden_layers' is {layers:,}; mlxkv plans models of up to "
        "1,024 layers (published models have under 200): fix config.json\n"
    )
    assert cfg.read_text() == text


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


@pytest.mark.parametrize(
    "change, words",
    [
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 1e308,
                              "original_max_position_embeddings": 8192}},
            "rope_scaling.factor 1e+308 x original_max_position_embeddings 8192 is past any "
            "model's context; fix config.json",
        ),
        (
            {"max_position_embeddings": None, "max_seq_len": 10**15},
            "max_seq_len is 1e+15 tokens, past any model's context; fix config.json",
        ),
    ],
)  # fmt: skip
def test_a_context_past_any_model_is_refused(tmp_path, capsys, change, words):
    """A YaRN factor of 1e308 was an OverflowError traceback; 1e15 tokens was planned."""
    config = json.loads(
        (Path(__file__).parent / "data/configs/published/llama-3-8b.json").read_text()
    )
    config.update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert refused(capsys, "plan", str(tmp_path / "config.json")) == f"mlxkv plan: error: {words}"


def test_a_folder_it_may_not_enter_is_one_line(tmp_path):
    """As a user without root: pathlib's is_dir raised PermissionError (a traceback) in
    plan, generate and pull."""
    import os
    import shutil

    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) drops root's permission override")
    folder = tmp_path / "locked"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    folder.chmod(0)
    try:
        drop = [setpriv, "--bounding-set", "-dac_override,-dac_read_search,-fowner"]
        if os.geteuid() != 0:
            drop = []
        for args in (["plan", str(folder)], ["generate", "-m", str(folder), "-p", "hi"]):
            run = subprocess.run(
                [*drop, sys.executable, "-m", "mlxkv", *args], capture_output=True, text=True,
                timeout=120,
            )  # fmt: skip
            assert run.returncode == 2 and run.stderr == (
                f"mlxkv {args[0]}: error: {folder / 'config.json'}: permission denied; check "
                "its permissions (and its folders')\n"
            )
    finally:
        folder.chmod(0o755)


@pytest.mark.parametrize("group", [48, 100000])
def test_a_quantization_group_mlx_cannot_pack_is_refused(tmp_path, capsys, group):
    """No layer divides by 48: the 4-bit checkpoint was planned as 16 GB of bf16 weights."""
    config = json.loads((PUBLISHED / "llama-3-8b.json").read_text())
    config["quantization"] = {"bits": 4, "group_size": group}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert refused(capsys, "plan", str(tmp_path / "config.json")) == (
        f"mlxkv plan: error: quantization.group_size {group!r} is not one MLX packs weights "
        "in (32, 64, 128); fix config.json"
    )


@pytest.mark.parametrize(
    "config, words",
    [
        (
            {"ffn_config": {"moe_num_experts": 100_000}},
            "'ffn_config.moe_num_experts' is 100,000; mlxkv plans models of up to 4,096 experts "
            "(published models have at most 512)",
        ),
        (
            {"num_transformer_layers": 20_000},
            "'num_transformer_layers' is 20,000; mlxkv plans models of up to 1,024 layers",
        ),
        (
            {"num_query_heads": [4] * 20_000},
            "'num_query_heads' holds 20,000 entries; mlxkv plans models whose lists have up to "
            "4,096",
        ),
    ],
)
def test_counts_in_any_spelling_are_refused_before_mlx_lm_builds_the_model(tmp_path, config, words):
    """A dbrx config with 100,000 experts took 4.2 GB and 47 s; an openelm one with 20,000
    layers spelled num_transformer_layers, 4.5 GB and 41 s."""
    cfg = tmp_path / "config.json"
    text = json.dumps({**json.loads(LLAMA.read_text()), **config})
    cfg.write_text(text)
    out = plan_out(str(cfg), timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith(f"mlxkv plan: error: {words}"), out.stderr
    assert out.stderr.endswith(": fix config.json\n") and cfg.read_text() == text
