"""The GPU rule's facts, checked on the CPU: which backend, which dtype and packing each
``--dtype`` gives, and what ``plan --backend cuda`` assumes (the GPU's memory, packed
weights, cuDNN's fused attention; none of the Mac's wired-limit advice)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.plan_cli import LLAMA31, LLAMA31_4BIT, plan_json

GiB = 2**30
BF16_CONFIG = {"model_type": "llama", "torch_dtype": "bfloat16"}


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXKV_HOME", str(tmp_path / "home"))


def _gpu_machine() -> bool:
    from mlxkv.memory import dtypes

    return dtypes.backend() != "cpu"


@pytest.mark.skipif(_gpu_machine(), reason="this machine runs MLX on a GPU")
def test_backend_on_this_machine_is_cpu_without_importing_mlx():
    code = (
        "import sys; from mlxkv.memory.dtypes import backend; "
        "print(backend(), 'mlx.core' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.split() == ["cpu", "False"], out.stderr


def test_mlxkv_device_cpu_forces_the_cpu(monkeypatch):
    from mlxkv.memory import dtypes

    monkeypatch.setattr(dtypes.sys, "platform", "darwin")
    monkeypatch.setattr(dtypes.platform, "machine", lambda: "arm64")
    assert dtypes.backend() == "metal"
    monkeypatch.setenv("MLXKV_DEVICE", "cpu")
    assert dtypes.backend() == "cpu"


@pytest.mark.parametrize(
    "dtype, on, want",
    [
        ("auto", "cpu", ("float32", False)),
        ("auto", "metal", ("bfloat16", True)),
        ("auto", "cuda", ("bfloat16", True)),
        ("native", "cpu", ("bfloat16", True)),  # the GPU rule, named on the CPU
        ("native", "cuda", ("bfloat16", True)),
        ("float16", "cpu", ("float16", False)),
        ("float16", "cuda", ("float16", True)),
        ("float32", "metal", ("float32", True)),
    ],
)
def test_weight_rule_per_backend(dtype, on, want):
    from mlxkv.models.loader import weight_rule

    assert weight_rule(BF16_CONFIG, dtype, on) == want


def test_gpu_rule_without_a_config_dtype_is_float16():
    from mlxkv.memory.dtypes import default_kv_dtype
    from mlxkv.models.loader import weight_rule

    assert weight_rule({"model_type": "llama"}, "native", "cpu") == ("float16", True)
    assert default_kv_dtype({"model_type": "llama"}, on="cuda") == "float16"


def test_plan_cuda_plans_packed_weights_in_the_gpus_memory(capsys):
    cuda = ["--backend", "cuda", "--memory", "80GB", "--context", "32768"]
    _, metal = plan_json(capsys, LLAMA31_4BIT, "--backend", "metal", "--memory", "64GB")
    code, d = plan_json(capsys, LLAMA31_4BIT, *cuda)
    assert code == 0 and d["backend"] == "cuda" and d["fits"]
    assert d["weights_bytes"] == metal["weights_bytes"]  # packed, as on a Mac
    assert d["kv_dtype"] == "bfloat16" and d["fused_attention"]
    assert d["available_bytes"] == 80 * 10**9  # the GPU's memory as given, no working set
    assert d["wired_limit"] is None and d["load_wired_limit_bytes"] is None
    _, cpu = plan_json(capsys, LLAMA31_4BIT, "--backend", "cpu", "--memory", "80GB")
    assert cpu["weights_bytes"] > 3 * d["weights_bytes"]  # float32, dequantized


def test_cuda_fused_attention_needs_half_precision_activations(capsys):
    from mlxkv.memory.config import load_config
    from mlxkv.memory.runtime import fused_attention
    from mlxkv.memory.store import layout_for

    layout = layout_for(load_config(LLAMA31))
    assert fused_attention(layout, "cuda", "bfloat16")
    assert not fused_attention(layout, "cuda", "float32")
    assert not fused_attention(layout, "cpu", "bfloat16")
    argv = ["--backend", "cuda", "--memory", "80GB", "--kv-dtype", "float32"]
    _, d = plan_json(capsys, LLAMA31, *argv)
    assert d["backend"] == "cuda" and not d["fused_attention"]  # scores held, as on the CPU


@pytest.mark.skipif(_gpu_machine(), reason="this machine runs MLX on a GPU")
def test_a_cuda_wheel_without_a_usable_gpu_is_the_cpu(monkeypatch):
    """mlx-cuda installed where MLX cannot use a GPU (no driver, or the CPU as default)."""
    import mlx.core as mx

    from mlxkv.memory import dtypes

    monkeypatch.setattr(dtypes, "_cuda_wheel", lambda: True)
    assert dtypes.backend() == "cpu"  # this machine: MLX sees no CUDA device
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert dtypes.backend() == "cpu"  # the default device is the CPU
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    assert dtypes.backend() == "cuda"
    monkeypatch.setenv("MLXKV_DEVICE", "cpu")
    assert dtypes.backend() == "cpu"
