"""The soak benchmark's workload against a real server, and its summary."""

from __future__ import annotations

import pytest

from mlxkv.bench.soak import KINDS, run, summary

SENTENCES = (
    "The ship left the harbour at dawn.", "Rain fell on the old stone bridge.",
    "A letter arrived for the captain.", "The garden was full of bees in June.",
)  # fmt: skip


def _samples(rss: list[float], active: float = 700.0) -> dict:
    rows = [
        {"t_s": i, "requests": 10 * i, "rss_mib": r, "active_mib": active, "weights_mib": 500.0,
         "prefix_mib": 150.0, "reserved_mib": 0.0, "responses_mib": 0.5, "rows": 0}
        for i, r in enumerate(rss)
    ]  # fmt: skip
    return {"samples": [*rows, rows[-1] | {"idle": True}], "errors": []}


def test_a_flat_run_has_no_slope_and_a_climbing_one_has_its_own():
    flat = summary(_samples([600, 900, 1000, 1000, 1000, 1000, 1000]))
    assert flat["rss_slope_mib_per_100_requests"] == 0.0
    assert flat["rss_after_warmup_mib"] == 1000  # the first sample past a quarter (20 of 60)
    climbing = summary(_samples([600, 900, 1000, 1010, 1020, 1030, 1040], active=712.5))
    assert climbing["rss_slope_mib_per_100_requests"] == 100.0  # 10 MiB per 10 requests
    assert climbing["idle_active_beyond_weights_and_prefixes_mib"] == 62.5
    assert (climbing["requests"], climbing["rss_max_mib"]) == (60, 1040)


@pytest.mark.slow
def test_every_kind_of_request_runs_and_the_server_ends_idle(tmp_path):
    corpus = tmp_path / "corpus.txt"  # the workload reads 400 passages past word 5000
    corpus.write_text(" ".join(SENTENCES[i % 4] for i in range(8000)))
    flags = ["--prefix-cache-bytes", "64MB"]
    result = run(tmp_path / "run", corpus, len(KINDS) * 2, 2, 600, 2, flags)
    assert result["errors"] == []
    assert set(result["kinds"]) == set(KINDS)
    idle = result["samples"][-1]
    assert idle["idle"] and idle["rows"] == 0 and idle["reserved_mib"] == 0
    assert idle["prefix_mib"] <= 64e6 / 2**20
    assert summary(result)["requests"] == len(KINDS) * 2
