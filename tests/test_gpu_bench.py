"""benchmarks/gpu_bench.py on the CPU: its --quick mode end to end (the tiny llama), and
its one-line refusals. The numbers themselves are the GPU machine's to measure
(docs/gpu.md); here the run must complete and report what it measured consistently."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlxkv.memory import policy_bytes as pb

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "gpu_bench.py"


def _bench(*args: str, out: Path | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(SCRIPT), "--device", "cpu", *args]
    if out is not None:
        argv += ["--out", str(out)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600)


def _check(result: dict, contexts, policies, weights) -> None:
    from mlxkv.bench.configs import all_configs
    from mlxkv.bench.gpu import QUICK, QUICK_KEPT, SINKS

    rows = result["rows"]
    assert [(r["weights"], r["context"], r["policy"]) for r in rows] == [
        (w, c, p) for c in contexts for w in weights for p in policies
    ]  # each context for every weight format before the next context
    configs = all_configs(QUICK_KEPT, SINKS)
    layers, kv_heads = QUICK["num_hidden_layers"], QUICK["num_key_value_heads"]
    for r in rows:
        assert min(r["prefill_tps"].values()) > 0 and min(r["decode_tps"].values()) > 0
        # the cache bytes the bound uses are mlxkv's bfloat16 cache after the run, exactly
        seen = r["context"] + result["decode_tokens"]
        policy = configs[r["policy"]].policy
        want = layers * pb.allocated_bytes(policy, kv_heads, 64, 64, 2, seen, 1)
        assert r["kv_bytes"]["mlxkv"] == want, r["policy"]
        assert r["plan"]["weights"] == r["weight_bytes"]  # plan --weight-bits 4 is nn.quantize's
        assert r["peak_bytes"] > r["weight_bytes"] and r["plan"]["mlx"] > r["plan"]["weights"]
        assert 0 < r["bound_fraction"] and r["decode_ratio"] > 0
        assert (r["batch_tps"] is not None) == (r["context"] == min(contexts))


def test_quick_subset_runs_and_reports_consistently(tmp_path):
    out = tmp_path / "gpu"
    done = _bench(
        "--quick", "--contexts", "256", "--policies", "full,sink-4bit", "--weights", "bf16",
        out=out,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.with_suffix(".json").read_text())
    _check(result, [256], ["full", "sink-4bit"], ["bf16"])
    table = out.with_suffix(".md").read_text()
    assert table == done.stdout and table.count("\n| bf16 | 256 |") == 2


@pytest.mark.slow  # about 20 s of CPU: bfloat16 and 4-bit matmuls have no CPU fast path
def test_quick_mode_runs_every_policy_weight_and_context(tmp_path):
    from mlxkv.bench.gpu import POLICIES

    done = _bench("--quick", out=tmp_path / "gpu")
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "gpu.json").read_text())
    _check(result, [256, 1024], list(POLICIES), ["bf16", "q4"])


def test_a_spent_budget_skips_the_rows_left_and_says_so(tmp_path):
    out = tmp_path / "gpu"
    done = _bench("--quick", "--contexts", "256", "--weights", "bf16", "--budget", "1e-9", out=out)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["rows"] == []
    assert result["skipped"][:2] == [
        {"weights": "bf16", "context": 256, "policy": "full", "sink_chunk": None},
        {"weights": "bf16", "context": 256, "policy": "sink-window", "sink_chunk": None},
    ]
    assert len(result["skipped"]) == 6 and "6 row(s) skipped" in done.stderr
    table = out.with_suffix(".md").read_text()
    assert "Not run (the --budget was spent): bf16 256 full, bf16 256 sink-window, " in table


def test_sink_chunks_run_each_sink_row_once_per_size_in_one_process(tmp_path):
    """--sink-chunk 16,128: every sink row once per size (the other policies once), the
    same tokens kept whatever the size, each row named by its size."""
    out = tmp_path / "gpu"
    done = _bench(
        "--quick", "--contexts", "1024", "--policies", "full,sink-window", "--weights", "bf16",
        "--sink-chunk", "16,128", out=out,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["policy"], r["sink_chunk"]) for r in rows] == [
        ("full", None),
        ("sink-window", 16),
        ("sink-window", 128),
    ]
    assert rows[1]["kv_bytes"] == rows[2]["kv_bytes"]  # sink 4 + window 124 either way
    table = out.with_suffix(".md").read_text()
    assert "| bf16 | 1,024 | sink 4 + window 124, evicting chunks of 16 (Rotating" in table
    assert "| bf16 | 1,024 | sink 4 + window 124, evicting chunks of 128 (Rotating" in table
    assert "prefill 64 tokens per call where their row names no other size" in table
    assert "sink-window  chunk 16 decode " in done.stderr


PEAK = SCRIPT.with_name("gpu_peak.py")


def _peak(*args: str, env=None) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(PEAK), "--quick", "--device", "cpu", "--context", "300", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.slow  # a run each way on the tiny model; the script's own test below is quick
@pytest.mark.parametrize("side", ["mlxkv", "mlx-lm"])
def test_the_peak_probe_reports_one_run_and_the_settings_it_ran_under(side):
    import os

    from mlxkv.bench.gpu import QUICK

    env = dict(os.environ, MLX_MAX_OPS_PER_BUFFER="20")
    env.pop("MLX_USE_CUDA_GRAPHS", None)
    plain, presized = _peak("--side", side, env=env), _peak("--side", side, "--presize")
    assert plain.returncode == 0 and presized.returncode == 0, plain.stderr + presized.stderr
    plain, presized = json.loads(plain.stdout), json.loads(presized.stdout)
    assert plain["env"] == {"MLX_MAX_OPS_PER_BUFFER": "20"} and presized["env"] == {}
    assert (plain["side"], plain["presize"], presized["presize"]) == (side, False, True)
    layers, kv_heads = QUICK["num_hidden_layers"], QUICK["num_key_value_heads"]
    per_slot = layers * kv_heads * 64 * 2 * 2  # keys and values, bfloat16
    # 300 + 4 decoded tokens: grown, the cache holds 512 slots (mlx-lm's steps as mlxkv's);
    # presized, the 512 slots given before the prefill, which it never outgrows
    assert plain["kv_bytes"] == presized["kv_bytes"] == 512 * per_slot
    assert plain["plan"]["kv"] == 512 * per_slot
    assert plain["peak_bytes"] >= plain["peak_after_prefill"] > plain["plan"]["weights"]
    assert plain["excess_over_kv"] == pytest.approx(
        (plain["peak_bytes"] - plain["plan"]["mlx"]) / plain["kv_bytes"]
    )


def test_the_peak_probe_sizes_only_the_full_cache():
    done = _peak("--policy", "4bit", "--presize")
    assert done.returncode == 2 and done.stdout == ""
    want = "gpu_peak: --presize: only the full cache can be sized before its prefill\n"
    assert done.stderr == want


def test_the_device_script_brings_back_one_archive_and_names_each_step(tmp_path):
    """The device tool returns at most 8 files from $OUT: the script leaves one archive
    there, and its console names each step's outcome. Here (no GPU) each probe and
    benchmark stops at its one-line refusal, which the console shows."""
    import os
    import tarfile

    import mlx.core as mx

    if mx.metal.is_available() or mx.cuda.is_available():
        pytest.skip("this machine has a GPU: the script would run the 8B-shaped model")
    script = SCRIPT.with_name("gpu_device.sh")
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    env = dict(os.environ, PATH=path, TMPDIR=str(tmp_path))
    out = tmp_path / "out"
    # a deadline of 145 s: packed's 150 s never fits, the probes' 45 s and bench4k's 120 s do
    argv = ["bash", str(script), "-", str(out), "145", "packed", "peak", "peakfull", "bench4k"]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=300, env=env, cwd=SCRIPT.parent.parent
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["results.tgz"]
    assert len(list(tmp_path.glob("gpu-device.*"))) == 1  # the work folder, under TMPDIR
    with tarfile.open(out / "results.tgz") as tar:
        names = sorted(n.removeprefix("./") for n in tar.getnames() if n != ".")
    assert names == ["bench4k.log", "device.txt", "peak.jsonl", "peak.log"]
    lines = done.stdout.splitlines()
    skip = [x for x in lines if x.startswith("packed skipped at ")]  # at 0 or 1 s
    assert len(skip) == 1 and skip[0].endswith(" s: its 150 s would pass the deadline of 145 s")
    refusal = (
        "gpu_peak: --device gpu: MLX sees no GPU here (install mlx-cuda-13, or use --device cpu)"
    )
    peaks = [x for x in lines if x.startswith("peak exit")]
    assert len(peaks) == 2 + 5 and all(x.startswith("peak exit 2 at ") for x in peaks)
    assert all(x.endswith(refusal) for x in peaks)
    assert any(x.startswith("bench4k exit 2 at ") for x in lines)
    assert "gpu_bench: --device gpu: MLX sees no GPU here" in done.stdout
    assert lines[-1].startswith("done at ")


def test_the_device_script_brings_back_the_compiled_kernels(tmp_path):
    """MLX's CUDA kernels, compiled at first use into MLX_PTX_CACHE_DIR, come back as
    $OUT/kernels.tgz for the next machine to carry: the same bytes."""
    import os
    import tarfile

    kernels = tmp_path / "kernels"
    kernels.mkdir()
    (kernels / "qmm_naive.ptx").write_bytes(b"\x7fELF compiled kernel")
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    env = dict(os.environ, PATH=path, TMPDIR=str(tmp_path), MLX_PTX_CACHE_DIR=str(kernels))
    out = tmp_path / "out"
    argv = ["bash", str(SCRIPT.with_name("gpu_device.sh")), "-", str(out), "5", "tests"]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=120, env=env, cwd=SCRIPT.parent.parent
    )
    assert done.returncode == 0, done.stderr
    assert "tests skipped at " in done.stdout
    assert "kernels: 1 files in OUT_DIR/kernels.tgz (" in done.stdout
    with tarfile.open(out / "kernels.tgz") as tar:
        assert tar.extractfile("./qmm_naive.ptx").read() == b"\x7fELF compiled kernel"


@pytest.mark.parametrize(
    "args, words",
    [
        (["--policies", "full,paged"], "--policies: unknown paged"),
        (["--weights", "fp8"], "--weights: unknown fp8"),
        (["--contexts", "4k"], "--contexts takes token counts"),
        (["--budget", "0"], "--budget must be a positive number of seconds"),
        (["--decode", "256"], "--decode must be 1 to 255 tokens, within one allocation step"),
        (["--sink-chunk", "1024"], "--sink-chunk must be 1 to 512 tokens (a prefill call's most)"),
        (["--sink-chunk", "64,big"], "--sink-chunk takes token counts like 64,512"),
        (["--device", "gpu"], "--device gpu: MLX sees no GPU here"),
    ],
)
def test_refusals_are_one_line(args, words):
    if "--device" in args:
        import mlx.core as mx

        if mx.metal.is_available() or mx.cuda.is_available():
            pytest.skip("this machine has a GPU")
    done = _bench("--quick", *args) if "--device" not in args else _gpu_here(args)
    assert done.returncode == 2 and words in done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def _gpu_here(args):
    argv = [sys.executable, str(SCRIPT), "--quick", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("weights", ["bf16", "q4"])
def test_the_8b_model_is_what_plan_predicts(weights):
    """The full-size model, built lazily (nothing allocated): its weight bytes are plan's,
    its KV per token Llama-3.1-8B's 131,072 B in bfloat16."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from mlxkv.bench.gpu import GROUP_SIZE, LLAMA31_8B, plan_parts
    from mlxkv.policy import KVPolicy

    model = llama.Model(llama.ModelArgs.from_dict(LLAMA31_8B))
    model.set_dtype(mx.bfloat16)
    if weights == "q4":
        nn.quantize(model, group_size=GROUP_SIZE, bits=4)
    lazy = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    plan = plan_parts(LLAMA31_8B, weights, KVPolicy(), 32768, "cuda")
    assert plan["weights"] == lazy
    assert plan["kv"] == 32768 * 131072 and plan["fused_attention"]


def test_a_run_that_mlx_refuses_is_reported_in_its_row_and_the_rest_runs(monkeypatch):
    """As MLX's CUDA backend refuses mlx-lm's QuantizedKVCache decode (no kernel for its
    shape): the row keeps mlxkv's numbers, shows ``fails`` for the other side, and names
    what MLX raised; the next row runs."""
    import mlx.core as mx
    from mlx_lm.models.cache import QuantizedKVCache

    from mlxkv.bench import gpu

    real_run = gpu._run

    def run_refusing_mlx_lm_quantized(model, factory, ids, decode, evicting=None):
        if isinstance(factory()[0], QuantizedKVCache):  # MLX's own refusal of a bad shape
            mx.eval(mx.quantized_matmul(mx.zeros((1, 24)), mx.zeros((8, 3), mx.uint32),
                                        mx.zeros((8, 1)), mx.zeros((8, 1))))  # fmt: skip
        return real_run(model, factory, ids, decode, evicting)

    monkeypatch.setattr(gpu, "_run", run_refusing_mlx_lm_quantized)
    s = gpu.settings(True, [256], ["4bit", "full"], ["bf16"], "cpu")
    result = gpu.run(s, log=lambda line: None)
    q4, full = result["rows"]
    assert set(q4["decode_tps"]) == {"mlxkv"} and q4["decode_ratio"] is None
    assert list(q4["errors"]) == ["mlx-lm"] and "quantized_matmul" in q4["errors"]["mlx-lm"]
    assert full["errors"] == {} and set(full["decode_tps"]) == {"mlxkv", "mlx-lm"}
    table = gpu.markdown(result)
    row = next(line for line in table.splitlines() if "4-bit (QuantizedKVCache(4))" in line)
    assert row.count("fails") == 2 and "| bf16 | 256 |" in row
    assert f"- bf16 256 QuantizedKVCache(4) (mlx-lm): {q4['errors']['mlx-lm']}" in table
