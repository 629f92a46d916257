"""``mlxkv plan``: verdicts, JSON, and bad input (exit 2, one line, no traceback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.plan_cli import plan_json, run_plan

PUBLISHED = Path(__file__).parent / "data" / "configs" / "published"
JSON_KEYS = {
    "model_type", "layers", "kv_bytes_per_token", "kv_bytes", "kv_bytes_allocated",
    "weights_bytes", "weights_source", "activation_bytes", "overhead_bytes", "total_bytes",
    "available_bytes", "fits", "max_context", "max_batch",
}  # fmt: skip


pytestmark = pytest.mark.usefixtures("fresh_home", "cpu_device")


def test_json_keys_and_a_fit(capsys):
    code, d = plan_json(capsys, str(PUBLISHED / "qwen2.5-7b-instruct.json"), "--memory", "64GiB")
    assert code == 0 and d["fits"] and JSON_KEYS <= set(d)
    assert d["model_type"] == "qwen2" and len(d["layers"]) == 28
    first = d["layers"][0]
    assert (first["kind"], first["kv_heads"], first["head_dim"], first["window"]) == (
        "attention",
        4,
        128,
        None,
    )
    # CPU backend: the engine runs float32, so 2 x 28 x 4 x 128 x 4 B.
    assert d["kv_dtype"] == "float32" and d["kv_bytes_per_token"] == 114_688
    assert d["kv_bytes"] == 4096 * 114_688
    assert d["total_bytes"] <= d["available_bytes"] and d["max_context"] >= 4096


def test_deepseek_v3_does_not_fit_on_this_machine(capsys):
    code, d = plan_json(capsys, str(PUBLISHED / "deepseek-v3.json"), "--memory", "24GB")
    assert code == 1 and not d["fits"]
    assert d["kv_bytes_per_token"] == 61 * 576 * 4  # float32 on the CPU
    assert d["weights_bytes"] > 2 * 10**12  # 671B params x 4 B
    assert d["max_context"] == 0 and d["max_batch"] == 0
    assert any("weights alone" in n for n in d["notes"])


def test_human_output(capsys):
    code = run_plan(str(PUBLISHED / "gemma-3-4b-it.json"), "--memory", "64GiB", "--context", "8192")
    out = capsys.readouterr().out
    assert code == 0
    words = ["weights", "KV logical", "KV allocated", "activations", "overhead", "total"]
    words += ["available", "FITS", "largest context", "largest batch", "RotatingKVCache"]
    for word in words:
        assert word in out


def test_policy_changes_the_kv(capsys):
    cfg = str(PUBLISHED / "llama-3-8b.json")
    _, full = plan_json(capsys, cfg, "--memory", "64GiB", "--context", "32768")
    _, win = plan_json(
        capsys, cfg, "--memory", "64GiB", "--context", "32768", "--kv-window", "1024"
    )
    assert win["policy"]["sinks"] == 4  # default sinks with a window
    assert win["kv_bytes"] == 1028 * full["kv_bytes_per_token"]
    assert win["max_context"] is None  # every cache bounded: any length fits
    _, q4 = plan_json(capsys, cfg, "--memory", "64GiB", "--kv-bits", "4", "--kv-dtype", "float16")
    # 4-bit, group 64, fp16 scales/biases: 72 of 256 bytes per element row
    assert q4["kv_bytes_per_token"] == 32 * 2 * 8 * 72 * 128 // 128


def test_window_note_where_the_runtime_ignores_the_config(capsys):
    _, d = plan_json(
        capsys, str(PUBLISHED / "mistral-7b-v0.1.json"), "--memory", "64GiB", "--context", "16384"
    )
    assert any("sliding_window=4096" in n for n in d["notes"])


def test_largest_context_is_the_edge(capsys):
    cfg = str(PUBLISHED / "llama-2-7b.json")
    _, d = plan_json(capsys, cfg, "--memory", "40GB")
    edge = d["max_context"]
    assert 0 < edge < 10**6
    _, at = plan_json(capsys, cfg, "--memory", "40GB", "--context", str(edge))
    _, past = plan_json(capsys, cfg, "--memory", "40GB", "--context", str(edge + 1))
    assert at["fits"] and not past["fits"]
    # The edge (9,472) is past Llama 2's 4,096 trained tokens: flagged, and the exit says so.
    assert at["past_trained_context"] and at["trained_context"] == 4096
    assert run_plan(cfg, "--memory", "40GB", "--context", str(edge)) == 1
    assert run_plan(cfg, "--memory", "40GB", "--context", "4096") == 0


def _bad(capsys, *argv: str) -> str:
    assert run_plan(*argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mlxkv plan: error: ") and "Traceback" not in err
    return err


def test_bad_inputs(tmp_path, capsys):
    assert "does not exist" in _bad(capsys, str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    assert "not valid JSON" in _bad(capsys, str(tmp_path / "bad.json"))
    (tmp_path / "list.json").write_text("[1, 2]")
    assert "JSON object" in _bad(capsys, str(tmp_path / "list.json"))
    base = json.loads((PUBLISHED / "llama-2-7b.json").read_text())
    cases = {
        "wrong_type": ({**base, "num_hidden_layers": "32"}, "'num_hidden_layers'"),
        "unknown": ({**base, "model_type": "llamaX"}, "model_type 'llamaX' (did you mean 'llama'"),
        "heads": ({**base, "num_attention_heads": 30}, "not divisible by 'num_attention_heads'"),
        "kv_heads": ({**base, "num_key_value_heads": 5}, "'num_key_value_heads'"),
        "negative": ({**base, "hidden_size": -4096}, "'hidden_size' must be positive"),
        "no_type": ({k: v for k, v in base.items() if k != "model_type"}, "'model_type'"),
    }
    for name, (cfg, expected) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(cfg))
        assert expected in _bad(capsys, str(path)), name
    folder = tmp_path / "empty"
    folder.mkdir()
    assert "without config.json" in _bad(capsys, str(folder))
    assert "unknown model" in _bad(capsys, "not-a-model")


def test_bad_flags(capsys):
    cfg = str(PUBLISHED / "llama-2-7b.json")
    assert "--context must be at least 1" in _bad(capsys, cfg, "--context", "-5")
    assert "--context must be an integer" in _bad(capsys, cfg, "--context", "lots")
    line = _bad(capsys, cfg, "--context", "128k")
    assert line.endswith(
        "--context must be an integer, got '128k' (write 131072 for 128K tokens)\n"
    )
    assert "--memory" in _bad(capsys, cfg, "--memory", "16 parsecs")
    assert "--kv-dtype" in _bad(capsys, cfg, "--kv-dtype", "int8")
    assert "--kv-bits 7" in _bad(capsys, cfg, "--kv-bits", "7")
    assert "--kv-sinks needs a window" in _bad(capsys, cfg, "--kv-sinks", "4")
    mamba = str(PUBLISHED / "mamba-130m.json")
    assert "do not apply" in _bad(capsys, mamba, "--kv-window", "512")


def test_unreachable_hub_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable once, at import (a probe may have imported it).
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    err = _bad(capsys, "nobody-here/no-such-model")
    assert "config.json" in err
    # names the hub's own rules refuse are no repo id: huggingface_hub's error was a traceback
    for name in ("org/x..y", "org/-x", "org/x.", "org/" + "a" * 100):
        assert _bad(capsys, name).startswith(f"mlxkv plan: error: unknown model '{name}': not a ")


def test_through_the_cli(tmp_path):
    from tests.conftest import run_cli

    env = {"MLXKV_HOME": str(tmp_path), "MLXKV_DEVICE": "cpu"}
    ok = run_cli("plan", str(PUBLISHED / "mamba-130m.json"), "--memory", "8GB", env=env)
    assert ok.returncode == 0, ok.stderr
    assert "any (every cache is bounded)" in ok.stdout
    bad = run_cli("plan", str(tmp_path / "nope.json"), env=env)
    assert bad.returncode == 2 and bad.stderr.startswith("mlxkv plan: error: ")
    assert bad.stderr.count("\n") == 1
