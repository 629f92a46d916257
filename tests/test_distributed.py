"""Real ``mlx.launch`` runs over 127.0.0.1 (ring backend): the model split over ranks gives
the single-process tokens, and ``plan --hosts`` predicts each rank's bytes exactly.

Each launch takes ports that are free when it starts, below the kernel's ephemeral range: a
fixed range in that range was once taken by a client socket of a test on the other worker.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mlxkv.bench.serve import free_ports
from tests.batch_files import read_records
from tests.conftest import run_cli

BIN = Path(sys.executable).parent
# OpenBLAS's thread count changes float summation order; sampled text then differs in the
# last bits. The ranks run with one thread, as this process does (tests/conftest.py), where
# the single-process references run (the ``cli`` fixture).
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1"}
TIMEOUT = 900  # a shared 2-core machine makes every collective slow; never hang forever


CONFIGS = Path(__file__).parent / "data" / "configs" / "published"


def launch_cmd(n: int, *args: str) -> list[str]:
    """``mlx.launch -n N --starting-port P -- mlxkv ARGS`` as a user types it, P free."""
    port = str(free_ports(n))
    return [
        str(BIN / "mlx.launch"),
        "-n",
        str(n),
        "--starting-port",
        port,
        "--",
        str(BIN / "mlxkv"),
        *args,
    ]


def launch(n: int, *args: str, timeout: int = TIMEOUT):
    """Run ``launch_cmd``; a port taken between the check and the bind (another process's
    listener) is the one failure tried again, on other ports."""
    env = {**os.environ, **ONE_THREAD}  # N ranks share the cores
    for _ in range(3):
        run = subprocess.run(
            launch_cmd(n, *args), capture_output=True, text=True, env=env, timeout=timeout
        )
        if "Couldn't bind socket" not in run.stderr:
            break
    return run


def last_json(out) -> dict:
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, (out.stdout, out.stderr)  # only rank 0 prints
    return json.loads(lines[0])


POLICIES = {
    "full": [],
    "sinks+window": ["--kv-window", "16", "--kv-sinks", "4"],
    "4-bit": ["--kv-bits", "4", "--kv-group-size", "32"],
}


@pytest.mark.parametrize(
    "policy",
    # KIVI keys meet mlx-lm's pipeline send in their own way (the send rides on the value
    # store), so 4-bit runs in CI; the full cache and the window take the plain path it also
    # takes through the same split (slow: each run is two ranks loading, 13 s on two cores).
    [p if p == "4-bit" else pytest.param(p, marks=pytest.mark.slow) for p in POLICIES],
)
def test_pipeline_over_two_ranks_samples_the_single_process_tokens(cli, tiny_qwen2, policy):
    """Sampling (temperature 1, a seed) turns any difference in the logits into different
    text; the pipeline's uneven 3 + 2 layer split must change nothing."""
    args = ["--model", str(tiny_qwen2), "--prompt", "Hello there, how are you doing today?"]
    args += ["--max-tokens", "24", "--temp", "1", "--seed", "5", "--json", *POLICIES[policy]]
    one = cli("generate", *args)
    assert one.returncode == 0, one.stderr
    two = launch(2, "generate", *args, "--shard", "pipeline")
    assert two.returncode == 0, two.stderr
    single, split = json.loads(one.stdout), last_json(two)
    assert split["text"] == single["text"]
    assert split["generation_tokens"] == single["generation_tokens"] == 24
    assert split["shard"] == "pipeline" and split["ranks"] == 2
    ranks = split["per_rank"]
    # Rank 0 runs the last 3 layers, rank 1 the first 2: the caches split 3 : 2.
    assert [r["kv_bytes_actual"] for r in ranks] == [r["kv_bytes_predicted"] for r in ranks]
    assert ranks[0]["kv_bytes_actual"] * 2 == ranks[1]["kv_bytes_actual"] * 3
    assert ranks[0]["kv_bytes_actual"] + ranks[1]["kv_bytes_actual"] == single["kv_bytes_actual"]


@pytest.mark.slow
def test_plan_hosts_pipeline_matches_what_each_rank_holds(tiny_qwen2):
    """Per-host weights and KV from plan --hosts 2 equal the real ranks' bytes, and the KV is
    the sum over the layers each rank holds (5 layers: ranks hold 3 and 2)."""
    args = ["--model", str(tiny_qwen2), "--prompt", "One two three", "--raw", "--json"]
    run = launch(2, "generate", *args, "--max-tokens", "4", "--shard", "pipeline")
    assert run.returncode == 0, run.stderr
    res = last_json(run)
    tokens = res["kv_tokens"]
    plan = run_cli(
        "plan", str(tiny_qwen2), "--hosts", "2", "--shard", "pipeline", "--context", str(tokens),
        "--json", "--memory", "8GB",
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    hosts = json.loads(plan.stdout)["per_host"]
    assert [h["layers"] for h in hosts] == [[2, 5], [0, 2]]
    for h, r in zip(hosts, res["per_rank"], strict=True):
        assert h["kv_bytes"] == r["kv_bytes_actual"]
        assert h["weights_bytes"] == r["weights_bytes"]
        layers = h["layers"][1] - h["layers"][0]
        # 2 KV heads x head_dim 32, keys and values, float32, per layer and token.
        assert h["kv_bytes_logical"] == layers * tokens * 2 * 2 * 32 * 4


def tensor_split_answers_as_one_process(cli, model, ranks: int, args: list[str]) -> dict:
    """``generate ARGS`` over ``ranks`` tensor-split ranks gives one process's text, and
    plan --hosts predicts each rank's KV and weights exactly; the split's JSON."""
    one = cli("generate", *args)
    assert one.returncode == 0, one.stderr
    run = launch(ranks, "generate", *args)
    assert run.returncode == 0, run.stderr
    single, split = json.loads(one.stdout), last_json(run)
    assert split["text"] == single["text"]
    assert split["shard"] == "tensor" and split["ranks"] == ranks
    tokens = split["kv_tokens"]
    plan = cli("plan", str(model), "--hosts", str(ranks), "--context", str(tokens), "--json")
    assert plan.returncode == 0, plan.stderr
    hosts = json.loads(plan.stdout)["per_host"]
    for h, r in zip(hosts, split["per_rank"], strict=True):
        assert r["kv_bytes_actual"] == r["kv_bytes_predicted"] == h["kv_bytes"]
        assert r["weights_bytes"] == h["weights_bytes"]
    assert sum(r["kv_bytes_actual"] for r in split["per_rank"]) == single["kv_bytes_actual"]
    split["logical_per_rank"] = [h["kv_bytes_logical"] for h in hosts]
    return split


def test_tensor_parallel_over_two_ranks_gives_the_single_process_answer(cli, tiny_qwen2):
    """The tiny qwen2 (2 KV heads) split over 2 ranks by default: the same sampled text (a
    random model's greedy text repeats one token; sampling at temperature 1 turns any wrong
    sum into other tokens, and the all-reduce's rounding flips one only at a near tie); each
    rank holds one KV head per layer and plan --hosts 2 predicts its bytes and weights."""
    args = ["--model", str(tiny_qwen2), "-p", "What is the capital of France?"]
    args += ["--max-tokens", "8", "--temp", "1", "--seed", "5", "--json"]
    split = tensor_split_answers_as_one_process(cli, tiny_qwen2, 2, args)
    assert split["generation_tokens"] == 8
    # 5 layers x 1 KV head (of 2) x head_dim 32, keys and values, float32.
    assert split["logical_per_rank"] == [5 * split["kv_tokens"] * 2 * 1 * 32 * 4] * 2


# Three ranks on two cores decode at about 0.46 tok/s (60 all-reduces a step among processes
# that outnumber the cores): 26 s in all beside the other test worker. Two ranks run above.
@pytest.mark.slow
def test_tensor_parallel_over_three_ranks_gives_the_single_process_answer(
    cli, preloaded, default_model_path
):
    """The default model (3 KV heads) split over 3 ranks: same greedy text; each rank holds
    one KV head per layer and plan --hosts 3 predicts its bytes and weights exactly."""
    # -p as the docs write it: after `--`, mlx.launch leaves it to mlxkv.
    args = ["-p", "What is the capital of France?", "--max-tokens", "3", "--json"]
    split = tensor_split_answers_as_one_process(cli, default_model_path, 3, args)
    # 30 layers x 1 KV head (of 3) x head_dim 64, keys and values, float32.
    assert split["logical_per_rank"] == [30 * split["kv_tokens"] * 2 * 1 * 64 * 4] * 3


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["sinks+window", "4-bit"])
def test_tensor_parallel_bounded_policies_give_the_single_process_answer(policy):
    """Sink re-rotation and 4-bit caches work on each rank's own KV head."""
    extra = ["--kv-window", "24", "--kv-sinks", "4"] if policy == "sinks+window" else []
    extra = extra or ["--kv-bits", "4"]
    # In one process each of this prompt's 6 greedy steps leads by 0.67 logits or more under
    # both policies. The ranks' sum rounds differently, and 4-bit keys can turn that into a
    # code step: "Name three colours." led by 0.02 at its fourth step, and the split flipped it.
    args = ["--prompt", "What is 2+2?", "--max-tokens", "6", "--json", *extra]
    one = run_cli("generate", *args, env=ONE_THREAD)
    assert one.returncode == 0, one.stderr
    three = launch(3, "generate", *args)
    assert three.returncode == 0, three.stderr
    assert last_json(three)["text"] == json.loads(one.stdout)["text"]


def test_a_taken_port_is_named_in_one_line(tiny_qwen2):
    """A rank whose ring port another process holds says so and what to change."""
    port = free_ports(2)
    env = {**os.environ, **ONE_THREAD}
    cmd = [str(BIN / "mlx.launch"), "-n", "2", "--starting-port", str(port), "--"]
    cmd += [str(BIN / "mlxkv"), "generate", "--model", str(tiny_qwen2), "-p", "hi"]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert run.stdout == "" and "Traceback" not in run.stderr
    assert (
        "mlxkv generate: error: cannot join the distributed group mlx.launch set up: "
        "[ring] Couldn't bind socket (error: 98); a port of this rank's is in use: give "
        "mlx.launch free ones (--starting-port)\n"
    ) in run.stderr


def test_a_split_that_cannot_work_is_refused_in_one_line(cli, default_model_path):
    """9 attention heads do not split 2 ways: plan and generate both say so, no traceback."""
    plan = cli("plan", str(default_model_path), "--hosts", "2")
    assert plan.returncode == 2 and plan.stdout == ""
    assert plan.stderr.strip() == (
        "mlxkv plan: error: tensor parallelism over 2 hosts needs attention heads divisible "
        "by 2; the model has 9: use a host count that divides 9 (mlx-lm has no pipeline "
        "split for llama)"
    )
    gen = launch(2, "generate", "--prompt", "hi", "--max-tokens", "2", timeout=300)
    # mlx.launch itself exits 0 whatever its ranks do: the ranks' stderr is what a user sees.
    assert gen.stdout == "" and "Traceback" not in gen.stderr
    assert (
        "mlxkv generate: error: tensor parallelism over 2 hosts needs attention heads "
        "divisible by 2; the model has 9" in gen.stderr
    )


def test_plan_hosts_bad_flags_are_one_line_errors(cli, default_model_path, tiny_qwen2):
    llama, qwen2 = str(default_model_path), str(tiny_qwen2)
    cases = {
        (llama, "--hosts", "3", "--memory", "8GB,4GB"): "--memory lists 2 sizes for 3 hosts",
        (llama, "--hosts", "x"): "--hosts must be an integer, got 'x'",
        (llama, "--hosts", "3", "--shard", "ring"): "--shard must be one of auto, tensor, pipeline",
        (llama, "--hosts", "3", "--shard", "pipeline"): (
            "llama has no model.pipeline() in mlx-lm: it cannot be split by pipeline; "
            "try --shard tensor"
        ),
        (qwen2, "--hosts", "6", "--shard", "pipeline"): (
            "a pipeline over 6 hosts needs at least 6 layers; the model has 5"
        ),
    }
    for flags, message in cases.items():
        out = cli("plan", *flags)
        assert out.returncode == 2, (flags, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (flags, out.stderr)


def test_auto_splits_by_layers_where_the_heads_do_not_divide(cli, tiny_qwen2):
    """4 heads do not split 3 ways; qwen2 has pipeline(): auto takes it (it said to use
    --shard pipeline instead)."""
    out = cli("plan", str(tiny_qwen2), "--hosts", "3", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["shard"] == "pipeline"
    out = cli("plan", str(tiny_qwen2), "--hosts", "3", "--shard", "tensor")
    assert out.returncode == 2 and out.stderr == (
        "mlxkv plan: error: tensor parallelism over 3 hosts needs attention heads divisible "
        "by 3; the model has 4: use a host count that divides 4, or --shard pipeline\n"
    )


def test_packed_weights_that_do_not_split_are_one_line(cli, tmp_path):
    """gpt-oss-20b in 4 bits: its experts' 45 groups of 64 do not split 2 ways. --hosts was
    a traceback, and --fit's host search crashed on it."""
    cfg = json.loads((CONFIGS / "gpt-oss-20b.json").read_text())
    cfg.pop("quantization_config", None)
    cfg["quantization"] = {"bits": 4, "group_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    mac = ["--backend", "metal", "--memory", "16GB"]
    out = cli("plan", str(tmp_path / "config.json"), *mac, "--hosts", "2")
    assert out.returncode == 2 and out.stderr == (
        "mlxkv plan: error: mlx-lm cannot split gpt_oss's weights 2 ways by tensor "
        "(ValueError: Array split does not result in sub arrays with equal size: attempting 2 "
        "splits along axis -1 for shape (32,2880,45)); use another host count\n"
    )
    out = cli("plan", str(tmp_path / "config.json"), *mac, "--context", "131072", "--fit")
    assert out.returncode == 1 and out.stderr == ""  # no host count splits it either
    assert out.stdout.endswith("--fit: no setting mlxkv can change makes it fit\n")


def test_plan_hosts_uses_each_hosts_memory(cli, default_model_path):
    """The tightest host bounds the plan: with 300 MB on host 2 it does not fit there."""
    out = cli(
        "plan", str(default_model_path), "--hosts", "3", "--memory", "8GB,8GB,300MB", "--json"
    )
    assert out.returncode == 1, out.stderr
    d = json.loads(out.stdout)
    assert [h["available_bytes"] for h in d["per_host"]] == [8 * 10**9, 8 * 10**9, 300 * 10**6]
    assert [h["fits"] for h in d["per_host"]] == [True, True, False]
    assert d["fits"] is False and d["tightest_host"] == 2
    assert d["max_batch"] == d["per_host"][2]["max_batch"] == 0


def test_data_parallel_batch_writes_the_single_process_records(cli, tiny_qwen2, tmp_path):
    """Two ranks, each a whole model: rank 0 hands out the prompts and writes one
    output whose texts are the single-process run's (a line held to a JSON schema too); a
    re-run has nothing left to do."""
    from tests.json_schemas import CITY

    prompts = ["What is 2+2?", "Name a colour.", "Say hello.", "What is the capital of Italy?"]
    lines = [{"id": i, "prompt": p} for i, p in enumerate(prompts)]
    lines.append({"id": 4, "prompt": "A city in Italy, as JSON.", "json_schema": CITY})
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    # Seeded sampling: each line's text is its own (greedy text of a random model repeats one
    # token), and a line's seed does not depend on which rank or batch runs it.
    flags = ["--model", str(tiny_qwen2), "--max-tokens", "6", "--batch-size", "2"]
    flags += ["--temp", "1", "--seed", "5", "--no-progress"]
    one = cli("batch", str(src), "-o", str(tmp_path / "one.jsonl"), *flags)
    assert one.returncode == 0, one.stderr
    out = tmp_path / "two.jsonl"
    two = launch(2, "batch", str(src), "-o", str(out), *flags, "--stats")
    assert "error:" not in two.stderr and "Traceback" not in two.stderr, two.stderr
    stats = last_json(two)
    assert stats["ranks"] == 2 and stats["shard"] == "data"
    assert stats["results"] == 5 and sum(stats["results_by_rank"]) == 5
    assert min(stats["results_by_rank"]) >= 2
    single = {r["id"]: r["text"] for r in read_records(tmp_path / "one.jsonl")}
    assert single[4].startswith('{"city"')  # held to the schema
    assert len(set(single.values())) == 5
    split = read_records(out)
    assert sorted(r["id"] for r in split) == [0, 1, 2, 3, 4]
    assert {r["id"]: r["text"] for r in split} == single
    again = launch(2, "batch", str(src), "-o", str(out), *flags)
    assert "nothing left to run" in again.stderr, again.stderr
    assert read_records(out) == split


@pytest.mark.slow
def test_an_embeddings_line_under_mlx_launch_is_its_error_record(tiny_qwen2, tmp_path):
    """Embeddings run on one machine: under two ranks an embeddings line is its error
    record, saying so, and the chat line beside it is answered."""
    embed = {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hi"}}
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(embed) + "\n" + json.dumps({"id": 1, "prompt": "Hi"}) + "\n")
    out = tmp_path / "out.jsonl"
    flags = ["--model", str(tiny_qwen2), "--max-tokens", "2", "--no-progress"]
    two = launch(2, "batch", str(src), "-o", str(out), *flags)
    assert "Traceback" not in two.stderr, two.stderr
    recs = {r.get("custom_id", r["id"]): r for r in read_records(out)}
    assert recs["e"]["error"]["message"] == (
        "embeddings run in a batch on one machine, not under mlx.launch; run it alone"
    )
    assert "text" in recs[1]


def _rank_pid(rank: int, marker: str) -> int | None:
    """The pid of the mlxkv process with MLX_RANK=rank whose command line has ``marker``."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in cmd and "mlxkv" in cmd and f"MLX_RANK={rank}".encode() in env:
            return int(proc.name)
    return None


@pytest.mark.slow
def test_a_dead_rank_stops_the_batch_and_a_rerun_loses_and_duplicates_nothing(tmp_path, tiny_qwen2):
    """Rank 1 is killed mid-job: rank 0 says so in one line and what is safe; the re-run
    finishes with every line answered exactly once, as a single process answers it."""
    import signal
    import time

    n = 12
    lines = [{"id": f"q{i}", "prompt": f"Tell me about number {i}", "seed": i} for i in range(n)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    flags = ["--model", str(tiny_qwen2), "--max-tokens", "40", "--temp", "1", "--batch-size", "1"]
    flags += ["--no-progress"]
    ref = run_cli("batch", str(src), "-o", str(tmp_path / "ref.jsonl"), *flags, env=ONE_THREAD)
    assert ref.returncode == 0, ref.stderr

    out = tmp_path / "out.jsonl"
    cmd = launch_cmd(2, "batch", str(src), "-o", str(out), *flags)
    env = {**os.environ, **ONE_THREAD}
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and job.poll() is None:
            if out.exists() and len(read_records(out)) >= 2:
                break
            time.sleep(0.2)
        pid = _rank_pid(1, str(out))
        assert pid is not None and job.poll() is None, "the job ended before rank 1 was killed"
        os.kill(pid, signal.SIGKILL)
        _, err = job.communicate(timeout=TIMEOUT)
    finally:
        if job.poll() is None:
            job.kill()
    assert "Traceback" not in err
    stop_lines = [ln for ln in err.splitlines() if ln.startswith("mlxkv batch: error:")]
    assert len(stop_lines) == 1, err
    assert f"are safe in {out}; run the same command again to resume" in stop_lines[0]
    kept = read_records(out)
    assert 2 <= len(kept) < n
    assert len({r["id"] for r in kept}) == len(kept)

    rerun = launch(2, "batch", str(src), "-o", str(out), *flags)
    assert f"resuming: {len(kept)} lines already in {out}" in rerun.stderr, rerun.stderr
    final = read_records(out)
    assert final[: len(kept)] == kept  # nothing rewritten
    assert sorted(r["id"] for r in final) == sorted(x["id"] for x in lines)  # once each
    expected = {r["id"]: r["text"] for r in read_records(tmp_path / "ref.jsonl")}
    assert {r["id"]: r["text"] for r in final} == expected


def test_each_rank_checks_its_own_share_before_loading(default_model_path):
    """The pre-load check under mlx.launch: rank 2 of 3 with 1 KV head per layer; a batch
    that cannot fit is refused in one line naming the rank, the mode and the plan."""
    from mlxkv.errors import UserError
    from mlxkv.memory.hosts import check_host_fits
    from mlxkv.policy import KVPolicy

    check_host_fits(default_model_path, KVPolicy(), 4096, 1, 3, 2, "auto")
    with pytest.raises(UserError) as err:
        check_host_fits(default_model_path, KVPolicy(), 4096, 100_000, 3, 2, "auto")
    message = str(err.value)
    assert message.startswith("rank 2 of 3 (tensor) needs about ")
    assert message.endswith("see 'mlxkv plan MODEL --hosts 3', or --force")


@pytest.mark.slow
def test_batch_over_a_tensor_split_model_writes_the_single_process_records(tmp_path):
    """--shard tensor: the ranks run every prompt in lockstep, rank 0 writes; greedy text
    equals one process's (sampled text may not: the all-reduce sums in another order)."""
    src = tmp_path / "in.jsonl"
    rows = [{"id": i, "prompt": p} for i, p in enumerate(["Say hello.", "What is 2+2?"])]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = ["--max-tokens", "5", "--batch-size", "2", "--no-progress"]
    one = run_cli("batch", str(src), "-o", str(tmp_path / "one.jsonl"), *flags, env=ONE_THREAD)
    assert one.returncode == 0, one.stderr
    out = tmp_path / "three.jsonl"
    three = launch(3, "batch", str(src), "-o", str(out), *flags, "--shard", "tensor")
    assert "error:" not in three.stderr and "Traceback" not in three.stderr, three.stderr
    single = {r["id"]: r["text"] for r in read_records(tmp_path / "one.jsonl")}
    assert {r["id"]: r["text"] for r in read_records(out)} == single


def test_stdin_under_mlx_launch_is_refused_not_waited_on(tmp_path):
    """mlx.launch hands its stdin on to the ranks and never closes it: reading '-' hung
    with no output until killed."""
    env = {**os.environ, **ONE_THREAD}
    for args, what in (
        (("batch", "-", "-o", str(tmp_path / "out.jsonl")), "the input"),
        (("generate", "--prompt", "-"), "--prompt"),
    ):
        run = subprocess.run(
            launch_cmd(2, *args), input='{"prompt": "hi"}\n', capture_output=True, text=True,
            env=env, timeout=TIMEOUT,
        )  # fmt: skip
        assert (
            f"mlxkv {args[0]}: error: {what} '-' reads stdin, which mlx.launch never closes for "
            "its ranks; give the input as a file\n"
        ) in run.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_ranks_started_with_other_options_are_refused(tmp_path):
    """Rank 1 with its own cache window answered its share of the prompts under it, and
    the records said rank 0's full cache."""
    wrapper = tmp_path / "mlxkv-rank"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ "$MLX_RANK" = 1 ]; then exec {BIN / "mlxkv"} "$@" --kv-window 8; fi\n'
        f'exec {BIN / "mlxkv"} "$@"\n'
    )
    wrapper.chmod(0o755)
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "hi"}\n{"id": "b", "prompt": "yo"}\n')
    cmd = launch_cmd(2, "batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"))
    cmd[cmd.index(str(BIN / "mlxkv"))] = str(wrapper)
    run = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, **ONE_THREAD}, timeout=TIMEOUT
    )
    assert (
        "mlxkv batch: error: rank 1 was started with other options than rank 0; run the same "
        "mlxkv command on every rank\n"
    ) in run.stderr
    assert not (tmp_path / "out.jsonl").exists()
