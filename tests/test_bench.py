"""``mlxkv bench``: the --quick smoke test (it runs and writes its report; the numbers are
not asserted, the machine is shared) and the bad-input answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli

# Any UTF-8 text works; the project's README is always there.
TEXT = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow  # a whole `bench --quick` (about a minute); the units below stay in CI
@pytest.mark.model
def test_quick_writes_report_and_results(default_model_path, tmp_path):
    out = run_cli("bench", "--quick", "--text", str(TEXT), "--out", str(tmp_path), timeout=900)
    assert out.returncode == 0, out.stderr
    report = tmp_path / "benchmarks.md"
    assert out.stdout.strip().endswith(str(report))
    md = report.read_text()
    for heading in ("## Command", "## Machine", "## Targets", "## Headline",
                    "## 1. Engine overhead", "## 2. Cache policies", "## 3. Long-stream quality",
                    "## 4. Roofline", "## 6. Prediction"):  # fmt: skip
        assert heading in md, heading
    assert "mlxkv bench --quick" in md
    res = json.loads((tmp_path / "bench-results.json").read_text())
    assert res["scale"]["name"] == "quick"
    for section in ("engine", "speed", "streams", "quality", "prediction", "roofline"):
        assert res["sections"][section], section
    for name in res["plots"]:
        assert (tmp_path / name).stat().st_size > 0
    from mlxkv.commands.bench import _holds_a_report

    assert _holds_a_report(tmp_path)  # a second run into this folder replaces the report


def test_missing_text_is_a_one_line_error(tmp_path):
    out = run_cli("bench", "--quick", "--text", str(tmp_path / "nope.txt"), "--out", str(tmp_path))
    assert out.returncode == 2
    assert "does not exist" in out.stderr
    assert "Traceback" not in out.stderr


def test_unknown_section_is_refused(tmp_path):
    out = run_cli(
        "bench", "--quick", "--text", str(TEXT), "--out", str(tmp_path), "--only", "speedy"
    )
    assert out.returncode == 2
    assert "unknown section" in out.stderr


def test_command_import_is_light():
    import subprocess
    import sys

    code = "import sys, mlxkv.commands.bench; print('mlx.core' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False"


@pytest.mark.model
def test_stream_losses_match_long_ppl(default_model):
    """The bench's stream scores tokens exactly as benchmarks/long_ppl.py does (one function)."""
    import numpy as np

    from mlxkv.bench import long_ppl
    from mlxkv.bench.configs import all_configs
    from mlxkv.bench.stream import run_stream

    model = default_model.model
    ids = default_model.tokenizer.encode(TEXT.read_text())[:97]
    cfg = all_configs(32, 4)["sink-window"]
    ours = run_stream("s", model, cfg.factory(model), ids, 16, (96,), decode=0).losses
    theirs = long_ppl.token_nll(model, ids, cfg.factory(model)(), 16)
    np.testing.assert_allclose(ours, theirs, atol=1e-4)


def test_flatness_of_a_bounded_stream_skips_the_fill():
    """Two fast 512-token fill chunks, then 64-token chunks at a constant 40 tok/s: flat
    from token 1024 on, not over the whole stream."""
    from mlxkv.bench.policies import flatness
    from mlxkv.bench.stream import StreamResult

    tokens = [512, 512] + [64] * 64
    seconds = [512 / 80, 512 / 80] + [64 / 40] * 64
    r = StreamResult("s", sum(tokens), 512, seconds, tokens)
    r.decode_start_tps = r.decode_end_tps = 5.0
    whole, steady = flatness(r), flatness(r, start=1024)
    assert whole["first10_tps"] == 80.0 and whole["last10_tps"] == 40.0
    assert steady["first10_tps"] == steady["last10_tps"] == 40.0
    assert steady["from_token"] == 1024 and steady["last_over_first"] == 1.0


def test_gate_lets_a_decode_timing_run_alone():
    """Prefill chunks overlap each other; an exclusive section never overlaps a chunk."""
    import multiprocessing as mp
    import threading
    import time

    from mlxkv.bench.pool import Gate

    gate, log = Gate(mp.get_context("spawn")), []

    def prefill():
        for _ in range(15):
            with gate.shared():
                log.append("in")
                time.sleep(0.004)
                log.append("out")

    def decode():
        for _ in range(3):
            time.sleep(0.01)
            with gate.exclusive():
                log.append("X")
                time.sleep(0.01)
                log.append("/X")

    threads = [threading.Thread(target=f) for f in (prefill, prefill, decode)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    depth, alone, overlapped = 0, False, False
    for event in log:
        depth += {"in": 1, "out": -1}.get(event, 0)
        overlapped |= depth == 2
        if event == "X":
            assert depth == 0 and not alone
            alone = True
        elif event == "/X":
            alone = False
        elif event == "in":
            assert not alone
    assert log.count("X") == 3 and overlapped


def test_a_regenerated_report_keeps_the_sections_measured_elsewhere():
    from mlxkv.bench.report import ELSEWHERE, keep_measured_elsewhere

    hand = f"{ELSEWHERE}\n\n## BLAS: prefill speed\n\n| a | b |\n"
    previous = "# old report\n\n## 1. old numbers\n\n" + hand
    assert keep_measured_elsewhere("# new report\n", previous) == "# new report\n\n" + hand
    assert keep_measured_elsewhere("# new report\n", "# old, nothing kept\n") == "# new report\n"
    assert keep_measured_elsewhere("# new report\n", None) == "# new report\n"
